"""What the checkpoint CRC check (integrations.checkpoints.damaged_record) costs against torch.load.

    .venv/bin/python bench/checkpoint_crc.py --gb 3 --file /tmp/big.pt

Writes a torch.save file of about GB gigabytes shaped like a ZeRO-3 optimizer-states file (fp32
flat groups, exp_avg and exp_avg_sq per subgroup; 4 subgroups), then times, each ``--repeat``
times with the file in the page cache (as a resume finds a checkpoint just copied or saved):
torch.load of it (as DeepSpeed loads it: map_location cpu, weights_only False) and the CRC check
of every record. The file is removed afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.0, help="file size in GB (default 3)")
    ap.add_argument("--file", default="/tmp/offloadctl-crc-bench.pt")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    import torch

    from integrations.checkpoints import damaged_record

    per_tensor = int(args.gb * 1e9 / 4 / 12)  # 4 subgroups x (fp32, exp_avg, exp_avg_sq), fp32
    if not os.path.exists(args.file):
        state = lambda make: make(per_tensor, device="cpu")  # a checkpoint's tensors, as torch.load gives them
        sd = {
            "optimizer_state_dict": {
                "state": {i: {"exp_avg": state(torch.randn), "exp_avg_sq": state(torch.rand)} for i in range(4)},
                "fp32_flat_groups": [state(torch.randn) for _ in range(4)],
            }
        }
        torch.save(sd, args.file)
        del sd
    size = os.path.getsize(args.file)
    try:
        load_s, crc_s = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            sd = torch.load(args.file, map_location="cpu", weights_only=False)
            load_s.append(time.perf_counter() - t)
            del sd
            t = time.perf_counter()
            assert damaged_record(args.file) is None
            crc_s.append(time.perf_counter() - t)
        threads = len(os.sched_getaffinity(0))
        print(
            json.dumps(
                {
                    "file_bytes": size,
                    "threads": threads,
                    "torch_load_s": min(load_s),
                    "crc_check_s": min(crc_s),
                    "crc_GB_per_s": size / min(crc_s) / 1e9,
                    "check_over_load": min(crc_s) / min(load_s),
                }
            )
        )
    finally:
        if not args.keep:
            os.unlink(args.file)


if __name__ == "__main__":
    main()
