"""The tests' one recipe for the Dion3 optimizer the CUDA-graph checks share."""


def normuon_quarter(params, graphed: bool, warmup_steps: int = 3, **options):
    """Dion3 (NorMuon, f = 1/4, weight decay 0.1, ``options``) over ``params[:-1]`` and AdamW
    over the last, and what steps it: a GraphedOptimizer (``warmup_steps`` eager steps) when
    ``graphed``."""
    from dion3_titan import Dion3
    from dion3_titan.optim.cuda_graph import GraphedOptimizer

    opt = Dion3(
        [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}],
        lr=0.02,
        fraction=0.25,
        flavor="normuon",
        weight_decay=0.1,
        **options,
    )
    return opt, (GraphedOptimizer(opt, warmup_steps=warmup_steps) if graphed else opt)
