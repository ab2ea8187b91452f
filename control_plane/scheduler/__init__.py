"""The scheduler: a plain, synchronous, deterministic object. State in, plan out."""
