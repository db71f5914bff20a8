"""Everything tp_train knows about Hugging Face families, one `FamilySpec` record per `model_type`, read with
`family(model_type)`; how to add one: docs/planner.md ("Family records")."""

from __future__ import annotations

from tp_train.plan.deciding.families import attention, recurrent, zamba, zoo_layouts
from tp_train.plan.deciding.families.spec import FamilySpec, family, family_of, register, registered, unregister

for _module in (attention, recurrent, zamba, zoo_layouts):
    for _record in _module.RECORDS:
        register(_record)

__all__ = ["FamilySpec", "family", "family_of", "register", "registered", "unregister"]
