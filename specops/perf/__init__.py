"""Performance tools beside the runtime: speedup model, workloads, advise, bench and tune."""
