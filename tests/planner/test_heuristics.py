"""The greedy plan (regen.planner.heuristics.greedy), the MILP's warm start: how low it reaches on its own."""

from regen.formats.plan import ACTION_SWAP
from regen.graphs.synthetic import transformer_profile
from regen.planner.graph import build_graph
from regen.planner.heuristics import greedy
from regen.planner.host_link import link_bandwidth
from regen.planner.simulator import simulate


def _graph(link_ratio: float):
    profile = transformer_profile(n_layers=6, batch=4, seq=128, d_model=128, n_head=4, copy_bytes_per_s=20e9)
    bw, _ = link_bandwidth(profile, None, link_ratio)
    return profile, build_graph(profile, bw, bw)


def test_greedy_starts_a_copy_in_after_the_step_its_prefetch_would_pass_the_cap_at():
    """Prefetching every copy-in at its window's first step holds the storages at backward's worst steps; the
    greedy starts those copy-ins later instead, and so reaches a lower peak than with the earliest starts."""
    profile, graph = _graph(0.3)
    choices = greedy(graph, 0, best_effort=True)
    later = [i for i, ch in choices.items()
             if ch.action == ACTION_SWAP and ch.swap_in_step > graph.candidates[i].in_breaks[0]]
    assert later
    earliest = {i: ch if i not in later else type(ch)(ACTION_SWAP, swap_in_step=graph.candidates[i].in_breaks[0])
                for i, ch in choices.items()}
    peak = simulate(graph, choices).peak_bytes
    assert simulate(graph, choices).valid and peak < simulate(graph, earliest).peak_bytes
    increase = profile.peak_bytes - profile.memory_at_start_bytes
    assert (peak - profile.memory_at_start_bytes) / increase < 0.31  # 0.321 with every copy-in at its earliest


def test_greedy_plans_stay_valid_at_every_reach():
    """Whatever it swaps or recomputes, and however late it starts a copy-in, the simulator accepts the plan."""
    _, graph = _graph(0.9)
    for fraction in (0.9, 0.7, 0.5):
        cap = int(graph.unplanned_peak_bytes * fraction)
        choices = greedy(graph, cap, best_effort=True)
        assert simulate(graph, choices).valid


def test_the_repeated_blocks_are_every_outermost_module_list():
    """Per-block checkpointing (the `checkpoint-blocks` strategy, a warm start of the MILP, the calibration's
    replay plan) replays both stacks of an encoder-decoder, not the list with the most children (a T5 decoder
    block's three sub-layers were that list); lists inside a block (sub-layers, experts) are not blocks."""
    from regen.planner.heuristics import outermost_block_parents

    t5 = ["encoder", "encoder.block.0", "encoder.block.0.layer.0", "encoder.block.0.layer.1", "encoder.block.1",
          "encoder.block.1.layer.0", "encoder.block.1.layer.1", "decoder.block.0", "decoder.block.0.layer.0",
          "decoder.block.0.layer.1", "decoder.block.0.layer.2", "decoder.block.1", "decoder.block.1.layer.0",
          "decoder.block.1.layer.1", "decoder.block.1.layer.2", "lm_head"]
    assert outermost_block_parents(t5) == ["decoder.block", "encoder.block"]
    mixtral = ["model.layers.0", "model.layers.0.mlp.experts.0", "model.layers.0.mlp.experts.1", "model.layers.1",
               "model.layers.1.mlp.experts.0", "model.layers.1.mlp.experts.1", "model.norm"]
    assert outermost_block_parents(mixtral) == ["model.layers"]
    assert outermost_block_parents(["model.layers.0", "model.norm"]) == ["model.layers"]  # a model of one layer
    assert outermost_block_parents(["model.norm", "lm_head"]) == []
    wrapped = ["0", *(f"0.model.layers.{k}" for k in range(3))]  # nn.Sequential(model): the wrapper is no block
    assert outermost_block_parents(wrapped) == ["0.model.layers"]
    albert = ["albert.encoder.albert_layer_groups.0", "albert.encoder.albert_layer_groups.0.albert_layers.0"] * 4
    assert outermost_block_parents(albert) == ["albert.encoder.albert_layer_groups"]  # one group, called per layer
