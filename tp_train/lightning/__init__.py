"""tp_train in Lightning: `TensorParallelStrategy`, its precision plugins, the callbacks (metrics, non-finite
guard, preemption, random state), the resumable loader, the Hydra-aware launcher and the rank watchdog."""
