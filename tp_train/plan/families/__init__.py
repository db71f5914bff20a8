"""Everything tp_train knows about Hugging Face families, one `FamilySpec` record per `model_type`, grouped by the
kind of family (`attention`, `recurrent`, `zamba`, `zoo_layouts`). The presets (`tp_train.plan.presets`), the
planner (through them) and the zoo read a family's record with `family(model_type)`.

To add a family, append one `FamilySpec` to the `RECORDS` of the module of its kind (or to a new module listed
below), with a comment saying what in the family's code each entry answers."""

from __future__ import annotations

from tp_train.plan.families import attention, recurrent, zamba, zoo_layouts
from tp_train.plan.families.spec import FamilySpec, family, family_of, register, registered, unregister

for _module in (attention, recurrent, zamba, zoo_layouts):
    for _record in _module.RECORDS:
        register(_record)

__all__ = ["FamilySpec", "family", "family_of", "register", "registered", "unregister"]
