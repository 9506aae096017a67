"""Expert parallelism: top-k routers with their auxiliary losses, token dispatch over the ep group, and
the mixture-of-experts MLP (docs/moe.md). Like the TP layers, the MoE layer is given its groups
(``tp_group``, ``ep_group``, ``cp_group``) at construction.
"""
from parallel.expert_parallel.dispatch import (DISPATCHERS, AllGatherDispatcher, AllToAllDispatcher, make_dispatcher,
                                               permute, unpermute)
from parallel.expert_parallel.layer import MoELayer, SwiGLUExpert, default_init
from parallel.expert_parallel.router import (DROP_POLICIES, SCORE_FUNCS, AuxLossInjector, Routing, RouterStats,
                                             TopKRouter, check_expert_tp, check_routing, drop_over_capacity,
                                             expert_capacity, load_balancing_loss, z_loss)

__all__ = ["MoELayer", "SwiGLUExpert", "TopKRouter", "Routing", "RouterStats", "AuxLossInjector",
           "AllToAllDispatcher", "AllGatherDispatcher", "make_dispatcher", "permute", "unpermute",
           "load_balancing_loss", "z_loss", "check_routing", "check_expert_tp", "default_init", "drop_over_capacity",
           "expert_capacity",
           "DISPATCHERS", "SCORE_FUNCS", "DROP_POLICIES"]
