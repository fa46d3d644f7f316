"""Floor 1, core: groups, the placement contract, differentiable collectives, fused linear ops."""
