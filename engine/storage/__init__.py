"""Storage tiers: swap paths and files, I/O backends, concurrency limits, block devices, native ops."""
