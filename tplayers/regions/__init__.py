"""Floor 2, regions: over core's column / row Functions, what a column -> row region does as a whole: its
backward as one Function (split backward, batch chunks; the interleaved pre-norm block), and the partial sums
a region leaves (an embedding's lookup left unsummed, PartialSum; the norms' partial weight gradients summed
by one all-reduce, PartialGradSum)."""
