"""Helpers shared by the entry points (lightning-hydra-template's utils home).

  io          atomic_open / atomic_write (the one atomic-write helper), write_run_metrics,
              explain_disk_full (a full disk -> one DiskFullError naming path, free space, fix)
  errors      report_errors: one clear line on stderr, the traceback in <run>/error.txt;
              RunDirCheck (Hydra callback: unwritable run directory -> one clear line)
  metrics_log the CSV metrics log: ResumableCSVLogger (a resume appends), read_metrics_log
  config      CONFIG_DIR, instantiate_list, Hydra run-mode queries
  checkpoint  write_checkpoint (atomic), read_checkpoint, check_compatible, resolve_checkpoint
              (clear CheckpointErrors)
  malloc      allocator tuning for CPU training
  precision   trainer.precision / channels_last resolved per device ("auto": bf16-mixed where native)
  threads     `threads: auto`: intra-op threads that leave cores to loader workers and busy neighbours
  profiling   peak_cpu_bytes: what a call allocates (benchmarks and tests)

Each module imports only what it needs, so `import bev.utils.io` stays cheap in workers.
"""
