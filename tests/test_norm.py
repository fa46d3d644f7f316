"""ParallelNorm conversions: frozen parameters stay frozen, and RMSNorm's default epsilon follows the
input dtype."""
import pytest
import torch
import torch.nn as nn

from _helpers import F64


def test_norm_conversion_keeps_frozen_parameters_frozen():
    # like every other from_dense/to_dense: requires_grad follows the source parameter, bias included
    from tplayers.layers.norm import ParallelNorm
    dense = nn.LayerNorm(4)
    dense.bias.requires_grad_(False)
    tp = ParallelNorm.from_dense(dense, group=None)
    assert tp.weight.requires_grad and not tp.bias.requires_grad
    tp.weight.requires_grad_(False)
    back = tp.to_dense()
    assert not back.weight.requires_grad and not back.bias.requires_grad
    rms = ParallelNorm.from_dense(nn.RMSNorm(4), group=None)
    assert rms.bias is None and rms.weight.requires_grad and rms.to_dense().weight.requires_grad


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # the point of the test
def test_rmsnorm_default_eps_follows_the_input_dtype():
    # nn.RMSNorm(eps=None) uses the INPUT dtype's epsilon at call time; freezing the weight
    # dtype's (float32: 1.2e-7) changed the result for float64 (or autocast bf16) inputs
    from tplayers.layers.norm import ParallelNorm
    dense = nn.RMSNorm(4)
    tp = ParallelNorm.from_dense(dense, group=None)
    x = torch.full((2, 4), 1e-4, dtype=F64)
    torch.testing.assert_close(tp(x), dense(x))
    torch.testing.assert_close(tp.to_dense()(x), dense(x))
    with pytest.raises(ValueError, match="eps=None"):
        ParallelNorm(4, "layernorm", None, group=None)
