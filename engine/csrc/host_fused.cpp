// The host lane's fused AdamW step (engine/host_fused.py): DeepSpeed's cpu_adam kernel, run
// with the gradient upcast and unscale before it and the 16-bit weight cast after it, tile by
// tile, in one OpenMP parallel region per call.
//
// Why: driven from Python chunk by chunk, each of those four ops is a parallel region of its
// own, ending in a barrier of every OpenMP thread, about 140 a step for a 7e7-parameter rank;
// and the ops pass over the chunk four times. Here each thread takes a contiguous run of tiles
// (16K elements: the tile's fp32 gradient, state and weights fit a core's L2 cache) and does all
// four ops on a tile before the next, so the gradient is read once, the state read and written
// once, the weights written once, and the threads meet once per call.
//
// Exactness: the update is DeepSpeed's own code (this file includes its kernel's source, built
// with the same builder's flags). Its math is elementwise, and every tile but the last is a
// multiple of SIMD_WIDTH * 8 elements, so each element goes through the same instructions as in
// one cpu_adam call over the whole run: the same scalar tail, the same vector body. The
// optimizer table (step count, bias corrections) is this module's own: every call of one
// kernel goes through this module (adam_update here is ds_adam_step), so the running products
// of beta1 and beta2 advance as stock's do.

#include "cpu_adam_impl.cpp"

#include <omp.h>

#include <cstring>

namespace {

constexpr int64_t kTileNumel = 1 << 14;  // a multiple of SIMD_WIDTH * 8 for every SIMD width

static_assert(kTileNumel % (16 * 8) == 0, "tiles must keep cpu_adam's vector body");

struct GradSegment {
    int64_t lo, hi;  // the run's elements this tensor holds
    const void* data;
    c10::ScalarType dtype;
};

// The fp32 gradient of elements [lo, lo + n) of a run into out, times scale where it is not 1.
inline void gather_grad(float* out, const std::vector<GradSegment>& segs, int64_t lo, int64_t n, float scale)
{
    const int64_t hi = lo + n;
    for (const auto& s : segs) {
        const int64_t x = std::max(lo, s.lo), y = std::min(hi, s.hi);
        if (x >= y) continue;
        float* dst = out + (x - lo);
        const int64_t m = y - x, from = x - s.lo;
        switch (s.dtype) {
            case c10::ScalarType::BFloat16: {
                const auto* src = static_cast<const uint16_t*>(s.data) + from;
                for (int64_t i = 0; i < m; ++i) {
                    const uint32_t u = static_cast<uint32_t>(src[i]) << 16;  // bf16 -> fp32 is exact
                    float f;
                    std::memcpy(&f, &u, 4);
                    dst[i] = f;
                }
                break;
            }
            case c10::ScalarType::Half: {
                const auto* src = static_cast<const c10::Half*>(s.data) + from;
                for (int64_t i = 0; i < m; ++i) dst[i] = static_cast<float>(src[i]);
                break;
            }
            default: std::memcpy(dst, static_cast<const float*>(s.data) + from, 4 * m);
        }
    }
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; ++i) out[i] = out[i] * scale;  // DeepSpeed's math: fp32 gradient * (1 / combined scale)
}

struct WeightTarget {
    int64_t lo, hi;
    void* data;
    c10::ScalarType dtype;
};

inline void write_weights(const std::vector<WeightTarget>& targets, const float* master, int64_t lo, int64_t n)
{
    const int64_t hi = lo + n;
    for (const auto& t : targets) {
        const int64_t x = std::max(lo, t.lo), y = std::min(hi, t.hi);
        if (x >= y) continue;
        const float* src = master + (x - lo);
        const int64_t m = y - x, at = x - t.lo;
        switch (t.dtype) {
            case c10::ScalarType::BFloat16: {
                auto* dst = static_cast<uint16_t*>(t.data) + at;
                for (int64_t i = 0; i < m; ++i) {  // round to nearest even, as torch's cast
                    uint32_t u;
                    std::memcpy(&u, src + i, 4);
                    dst[i] = std::isnan(src[i]) ? uint16_t(0x7FC0)
                                                : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
                }
                break;
            }
            case c10::ScalarType::Half: {
                auto* dst = static_cast<c10::Half*>(t.data) + at;
                for (int64_t i = 0; i < m; ++i) dst[i] = c10::Half(src[i]);
                break;
            }
            default: std::memcpy(static_cast<float*>(t.data) + at, src, 4 * m);
        }
    }
}

void check_flat(const torch::Tensor& t, const char* what)
{
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, " must be a contiguous host tensor");
}

}  // namespace

// One AdamW step of a run of a subgroup (elements [0, n) of master, exp_avg, exp_avg_sq, all
// fp32): its gradient is the concatenation of grads (each grads[k] holds elements
// [grad_offsets[k], grad_offsets[k] + grads[k].numel()); fp32, bf16 or fp16), times scale; the
// new master is cast into each weights[k] (elements [weight_offsets[k], ... + numel)).
void fused_step(int optimizer_id,
                size_t step,
                float lr,
                float beta1,
                float beta2,
                float epsilon,
                float weight_decay,
                torch::Tensor master,
                torch::Tensor exp_avg,
                torch::Tensor exp_avg_sq,
                std::vector<torch::Tensor> grads,
                std::vector<int64_t> grad_offsets,
                float scale,
                std::vector<torch::Tensor> weights,
                std::vector<int64_t> weight_offsets)
{
    const int64_t n = master.numel();
    for (const auto* t : {&master, &exp_avg, &exp_avg_sq}) {
        check_flat(*t, "state");
        TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->numel() == n, "state must be fp32 of one length");
    }
    TORCH_CHECK(grads.size() == grad_offsets.size() && weights.size() == weight_offsets.size(), "one offset per tensor");
    std::vector<GradSegment> segs;
    int64_t covered = 0;
    for (size_t k = 0; k < grads.size(); ++k) {
        check_flat(grads[k], "a gradient");
        TORCH_CHECK(grad_offsets[k] == covered, "the gradients must cover the run in order");
        const auto dt = grads[k].scalar_type();
        TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf, "gradient dtype");
        segs.push_back({covered, covered + grads[k].numel(), grads[k].data_ptr(), dt});
        covered += grads[k].numel();
    }
    TORCH_CHECK(covered == n, "the gradients must cover the run");
    std::vector<WeightTarget> targets;
    for (size_t k = 0; k < weights.size(); ++k) {
        check_flat(weights[k], "a weight");
        const auto dt = weights[k].scalar_type();
        TORCH_CHECK(dt == torch::kFloat32 || dt == torch::kBFloat16 || dt == torch::kHalf, "weight dtype");
        TORCH_CHECK(weight_offsets[k] >= 0 && weight_offsets[k] + weights[k].numel() <= n, "a weight outside the run");
        targets.push_back({weight_offsets[k], weight_offsets[k] + weights[k].numel(), weights[k].data_ptr(), dt});
    }
    auto found = s_optimizers.find(optimizer_id);
    TORCH_CHECK(found != s_optimizers.end(), "no optimizer ", optimizer_id, ": create_adam first");
    auto opt = std::static_pointer_cast<Adam_Optimizer>(found->second);
    opt->IncrementStep(step, beta1, beta2);  // as ds_adam_step: the running products of the betas
    opt->update_state(lr, epsilon, weight_decay, true);

    float* p = master.data_ptr<float>();
    float* m = exp_avg.data_ptr<float>();
    float* v = exp_avg_sq.data_ptr<float>();
    // The one fp32 gradient read in place where nothing is to be unscaled.
    const float* direct = segs.size() == 1 && segs[0].dtype == c10::ScalarType::Float && scale == 1.0f
                              ? static_cast<const float*>(segs[0].data)
                              : nullptr;
    const int64_t tiles = (n + kTileNumel - 1) / kTileNumel;
    pybind11::gil_scoped_release no_gil;  // the recorder's and the I/O threads' Python runs meanwhile
#pragma omp parallel
    {
        thread_local std::vector<float> scratch;
        if (direct == nullptr && scratch.size() < static_cast<size_t>(kTileNumel)) scratch.resize(kTileNumel);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t lo = t * kTileNumel, len = std::min(kTileNumel, n - lo);
            float* g = scratch.data();
            if (direct != nullptr)
                g = const_cast<float*>(direct) + lo;  // Step_8 reads the gradient, never writes it
            else
                gather_grad(g, segs, lo, len, scale);
            opt->Step_8(p + lo, g, m + lo, v + lo, static_cast<size_t>(len), false);
            write_weights(targets, p + lo, lo, len);
        }
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
    m.def("create_adam", &create_adam_optimizer, "DeepSpeed CPU Adam (C++), this module's table");
    m.def("destroy_adam", &destroy_adam_optimizer, "DeepSpeed CPU Adam destroy (C++)");
    m.def("adam_update", &ds_adam_step, "DeepSpeed CPU Adam update (C++), this module's table");
    m.def("fused_step", &fused_step, "the host lane's fused step: upcast, unscale, cpu_adam, weight cast");
}
