"""Deciding a plan: which plan a model gets (`resolve`: the caller's, the model's own, a family's record in
`families/`, or the auto-planner's `autoplan` with its probes, pairs, locality oracle, structure rules and local
views), validating it against the model (`match`), and where a model splits for the other dimensions, as data
(pipeline stages in `pipeline`, experts in `experts`). Imports nothing from `applying/` or `checking/`."""
