"""A block as the sum of its parts' declarations: its norms and residuals, its attention and its feed-forward."""

from dataclasses import dataclass

from trillion.models.parts.spec import ExpertStack, Heads, Linear, Norm, Part, Routing


@dataclass(frozen=True)
class Block:
    parts: tuple[Part, ...]  # the norms and residuals (module ""), then the attention, then the feed-forward

    @property
    def sublayers(self) -> tuple[Part, ...]:
        """The parts that fill a block attribute (attention, feed_forward), in the order the block runs them."""
        return tuple(p for p in self.parts if p.module)

    @property
    def norms(self) -> tuple[Norm, ...]:
        """The block's own norms (before each sublayer); the parts' inner norms are in `inner_norms`."""
        return tuple(n for p in self.parts if not p.module for n in p.norms)

    @property
    def inner_norms(self) -> tuple[Norm, ...]:
        return tuple(n for p in self.sublayers for n in p.norms)

    @property
    def linears(self) -> tuple[Linear, ...]:
        """Every linear one token's forward runs as a GEMM at its tp split (not the router, not the experts)."""
        return tuple(x for p in self.parts for x in p.linears)

    @property
    def experts(self) -> tuple[ExpertStack, ...]:
        return tuple(s for p in self.parts for s in p.experts)

    @property
    def heads(self) -> Heads:
        return next(p.heads for p in self.parts if p.heads is not None)

    @property
    def routing(self) -> Routing | None:
        return next((p.routing for p in self.parts if p.routing is not None), None)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)

    @property
    def inactive_numel(self) -> int:
        """The routed experts one token does not reach: (E - top_k) of each stack."""
        routing = self.routing
        if routing is None:
            return 0
        return sum(s.in_features * s.out_features for s in self.experts) * (routing.n_experts - routing.top_k)

    def saved_on_rank(self, tp: int) -> float:
        """Activation elements per token its parts keep beyond the block's norms, on one of `tp` ranks."""
        return sum(p.saved.split / tp for p in self.parts) + sum(p.saved.whole for p in self.parts)

    def elementwise_on_rank(self, tp: int, compiled: bool) -> float:
        """Element-wise elements read and written per token by its forward, on one of `tp` ranks."""
        work = [p.compiled if compiled else p.eager for p in self.parts]
        return sum(w.split for w in work) / tp + sum(w.whole for w in work)

    @property
    def eager_kernels(self) -> int:
        return sum(p.eager_kernels for p in self.parts)
