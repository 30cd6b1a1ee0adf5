"""train.py with paired initialisation: at one seed, every variant starts from the same values
of the parameters it shares with `full`, so a difference between variants at that seed is the
variant's, not the seed's.

    python experiments/paired.py --attn=dsa --seed=1 ...   # any train.py flags

Why it is needed. train.py seeds the global RNG once, and `model.Model` draws from it in
module order: first PyTorch's default init of every layer as it is constructed (the variant's
extra gate layers - dsa's head gate, asga's pair MLP, caa's mixing gate - among them), then
model.py's own init loop over all parameters. The variant's extra draws shift the stream, so
at the same --seed a variant starts from different values of the parameters it shares with
`full`. Measured at the tiny size, seed 3: for dsa, asga and caa all 15 shared weight
matrices differ from `full`'s (the embedding included, since its draw comes after every
layer's construction); for local, none (it has no extra parameters). The data order does not
need this: data.DistributedLoader draws its permutation from its own generator seeded by
--seed + epoch, whatever the model.

What this does. It builds `full`'s model at the run's --seed on a saved-and-restored global RNG
and copies each parameter the two models share (same name and shape) into the variant's model,
after the variant's own init. The variant's extra parameters keep the init its docstring
states. Nothing else of train.py changes (optimizer, schedule, data, logs, checkpoints; a
resumed run loads its checkpoint over this init).

The same thing done in the product (so that this wrapper can go): in `model.Model.__init__`,
initialise the shared parameters from a generator that does not see the variant's parameters,
e.g. `g = torch.Generator().manual_seed(seed)` passed to `nn.init.normal_(p, std, generator=g)`
for every parameter whose name is not one of the variant's own (attention.py would list them,
e.g. a `GATE_PARAMS` tuple per class), and draw the variant's own parameters from a second
generator afterwards. Then `python train.py --seed=S` is paired across variants by itself.
"""
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import config  # noqa: E402
import model as model_module  # noqa: E402
import train  # noqa: E402


def shared_init(model, cfg, seed):
    """Copy into `model` the initial value `full` has at `seed` of every parameter they share
    (same name, same shape). The global RNG is left as it was. Returns the names copied."""
    rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    reference = dict(model_module.Model(replace(cfg, attn="full")).named_parameters())
    torch.random.set_rng_state(rng)
    copied = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            ref = reference.get(name)
            if ref is not None and ref.shape == p.shape:
                p.copy_(ref)
                copied.append(name)
    return copied


def paired_model_class(seed):
    """A model.Model whose shared parameters start as `full`'s at `seed`."""

    class PairedModel(model_module.Model):
        def __init__(self, cfg):
            super().__init__(cfg)
            shared_init(self, cfg, seed)

    return PairedModel


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    tc = config.parse_args(argv, doc=train.__doc__)[0]  # the seed train.py will use (its default if not given)
    train.Model = paired_model_class(tc.seed)  # train.py builds its model through this name
    return train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
