"""regen's MILP (docs/milp.md): the formulation (model), solving it and reading a plan back (solution),
HiGHS (highs), the large-graph block search (blocks), and the search that the MILP strategies run:
warm start, simulator check and repair (search)."""
