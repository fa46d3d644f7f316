"""Floor 1, core: groups, the placement contract, the collectives, the column / row parallel linear Functions."""
