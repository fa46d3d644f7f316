"""Floor 4, models: dense twins and configs (the spec), rng, loss, transformer blocks, MoE, ParallelGPT."""
