"""What parallel.ep_overlap leaves of the expert all-to-alls' time exposed beside a pass's compute, where the
mechanism puts it (parallel/expert_parallel.py, parallel/expert_overlap.py): a layer's tokens in two chunks, each
chunk's all-to-alls beside the other's compute, or two micro-batches paired on one stage; a forward paired with a
backward across stages is priced turn by turn (pairing.py). moe.py exposed_seconds chooses between them."""


def chunks_exposed(mode: str, first: list, second: list, counts: float, shared: float, experts: float) -> float:
    """Seconds of one pass's all-to-alls (moe.py exposed_all_to_alls's arguments) left exposed by two chunks of the
    layer's tokens in dispatch `mode` (ExpertDispatch._one_hop, _by_node): each all-to-all's wait sees the compute run
    since its post: the counts the first chunk's shared experts; per rank or expert the first dispatch half the
    first shared experts with a capacity (dropless: nothing), the second the first chunk's experts, the first combine
    half the second chunk's experts, the last the second shared experts; per node `node_chunks_exposed`."""
    if mode == "node":
        return max(0.0, counts - shared / 2) + node_chunks_exposed(first, second, shared, experts)
    dispatch, combine = sum(first), sum(second)
    first_half = max(0.0, dispatch / 2 - (0.0 if counts else shared / 2))
    beside_experts = max(0.0, dispatch / 2 - experts / 2) + max(0.0, combine / 2 - experts / 2)
    return max(0.0, counts - shared / 2) + first_half + beside_experts + max(0.0, combine / 2 - shared / 2)


def node_chunks_exposed(first: list, second: list, shared: float, experts: float) -> float:
    """Seconds the per-node dispatch's four hops add to a pass that sends its tokens in two chunks, replayed in the
    order ExpertDispatch._by_node runs them: both chunks to their nodes; each, once there, on to its ranks; each,
    once there, through its experts and back in the node; each, once back, back over the network; the second half
    of the shared experts before the last waits. The network's and the node's all-to-alls run on streams of their
    own (one process group each), each in the order posted. A backward (autograd's reverse of that order) and a
    recomputed forward are priced by the same order."""
    (to_node, in_node), (back_in_node, back_to_node) = ([hop / 2 for hop in way] for way in (first, second))
    host = network = node = 0.0  # when the host, and each stream, is free
    arrived = []
    for _ in range(2):  # both chunks posted at once, one after the other on the network's stream
        network += to_node
        arrived.append(network)
    forwarded = []
    for at in arrived:
        host = max(host, at)
        node = max(node, host) + in_node
        forwarded.append(node)
    returned = []
    for at in forwarded:
        host = max(host, at) + experts / 2
        node = max(node, host) + back_in_node
        returned.append(node)
    for at in returned:
        host = max(host, at)
        network = max(network, host) + back_to_node
    return max(host + shared / 2, network) - experts - shared / 2


def exposed_paired(dispatch: float, combine: float, counts: float, segment: float) -> float:
    """Seconds of one pass's all-to-alls left exposed with two micro-batches in flight: each waits beside one
    segment of the other's compute, its pass between two of its posts (`segment`)."""
    return sum(max(0.0, phase - segment) for phase in (counts, dispatch, combine) if phase)
