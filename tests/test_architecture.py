"""The package's layers, read from its imports (ast), so that the tree keeps the design it shows:

    app -> lightning, tools -> training -> plan -> checkpoint -> parallel -> errors

A module may import from its own subpackage or any layer below (skipping levels is fine), never above; `lightning`
and `tools` never import each other; no module imports another module's `_private` name; Lightning, Hydra, OmegaConf
and datasets are imported only in `lightning/` and `app/`; only `tools/` imports the project's reference models
(`models`), and `models/` imports nothing from tp_train; there are no import cycles; and tp_train keeps at most 9
entries at its top level (its layers, errors.py and `__init__.py`). Inside plan/, deciding a plan, applying it and
checking it (`PLAN_JOBS`: plan/deciding/, plan/applying/, plan/checking/) import only their own job's modules and the
vocabulary all three share (plan/'s own modules, which import no job); `parallelize` runs the three. Only
`parallel/dims.py` (`ParallelDims`) multiplies or divides parallel degrees (tp x cp, world_size // tp, ...) and builds
the device mesh. lightning/ never branches on the data-parallel mode (argument refusals aside), nor
on the pipeline outside lightning/pipeline.py, where the strategy's step runner is chosen once at setup.
The checker is also run on a small tree with one broken rule of each kind, so each rule is shown to fire.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"errors": 0, "parallel": 1, "checkpoint": 2, "plan": 3, "training": 4, "tools": 5, "lightning": 5, "app": 6}
APP_FRAMEWORKS = ("lightning", "hydra", "omegaconf", "datasets")  # only in lightning/ and app/
FRAMEWORK_LAYERS = ("lightning", "app")


# plan/'s jobs, one sub-package each (plan/deciding/, plan/applying/, plan/checking/). Deciding never reaches into
# applying or checking (the rank simulation splits with the shared `ShardSpec`s and local views that `apply_plan`
# uses); the vocabulary all three share sits in plan/ itself and imports none of them; `parallelize` runs the three.
PLAN_JOBS = ("deciding", "applying", "checking")
PLAN_ENTRY = ("__init__", "parallelize")


def plan_job_problems(plan_root: Path) -> list[str]:
    """Every import inside `plan_root` from one job's sub-package (`PLAN_JOBS`) into another's, every import of a job
    from the shared vocabulary (plan/'s own modules, `PLAN_ENTRY` aside), and every sub-package that is no job, one
    line each."""
    package = f"{plan_root.parent.name}.{plan_root.name}"
    problems = [
        f"plan/{path.name}/ is no job: its modules go in one of {', '.join(PLAN_JOBS)}, or in plan/ if all three "
        "use them"
        for path in sorted(plan_root.iterdir())
        if path.is_dir() and path.name not in (*PLAN_JOBS, "__pycache__")
    ]

    def job_of(parts: tuple[str, ...]) -> str:
        return parts[0] if parts[0] in PLAN_JOBS else "shared"

    for path in sorted(plan_root.rglob("*.py")):
        parts = path.relative_to(plan_root).with_suffix("").parts
        if parts[0] not in PLAN_JOBS and len(parts) > 1 or parts in [(entry,) for entry in PLAN_ENTRY]:
            continue
        mine = job_of(parts)
        for imported, _, line in _imports(path, set()):
            if not imported.startswith(package + "."):
                continue
            other = job_of(tuple(imported[len(package) + 1 :].split(".")))
            if other != mine and other != "shared":
                where = "/".join(parts)
                problems.append(f"plan/{where}.py:{line}: {mine} imports {imported} ({other})")
    return problems


def _module_name(package_root: Path, path: Path) -> str:
    parts = path.relative_to(package_root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in `path`, at any depth. `from pkg import
    sub` counts as importing the submodule when `pkg.sub` is a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append(
                    (submodule, None, node.lineno) if submodule in modules else (node.module, alias.name, node.lineno)
                )
    return found


def _layer(module: str, package: str) -> str | None:
    """'parallel', 'plan', ... for a module of the package; None for the package's own `__init__` (its public API)."""
    parts = module.split(".")
    if parts[0] != package or len(parts) == 1:
        return None
    return parts[1]


def import_problems(package_root: Path, models_root: Path | None = None) -> list[str]:
    """Every broken rule in the package at `package_root` (and `models_root`), one line each."""
    package = package_root.name
    paths = {_module_name(package_root, path): path for path in sorted(package_root.rglob("*.py"))}
    modules = set(paths)
    problems, graph = [], {}
    top_level = sorted(path.name for path in package_root.iterdir() if path.name != "__pycache__")
    if len(top_level) > 9:
        problems.append(f"{package}/ has {len(top_level)} entries at its top level (at most 9): {top_level}")
    for module, path in paths.items():
        layer = _layer(module, package)
        where = f"{path.relative_to(package_root.parent)}"
        graph[module] = set()
        for imported, name, line in _imports(path, modules):
            head = imported.split(".")[0]
            if head in APP_FRAMEWORKS and layer is not None and layer not in FRAMEWORK_LAYERS:
                problems.append(f"{where}:{line}: imports {imported} below lightning/ and app/")
            if head == "models" and layer not in (None, "tools"):
                problems.append(f"{where}:{line}: imports the reference models ({imported}); only tools/ may")
            if head != package:
                continue
            target = imported if imported in modules else None
            if target is None:
                continue
            graph[module].add(target)
            if name and name.startswith("_") and target != module:
                problems.append(f"{where}:{line}: imports the private name {name} from {target}")
            other = _layer(target, package)
            if layer is None or other is None or other == layer:
                continue
            if {layer, other} == {"lightning", "tools"}:
                problems.append(
                    f"{where}:{line}: {layer}/ imports {target} ({other}/): the two never import each other"
                )
            elif LAYERS.get(other, 0) >= LAYERS.get(layer, 0):
                problems.append(f"{where}:{line}: {layer}/ imports {target}, a layer above or beside it ({other}/)")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    if models_root is not None:
        for path in sorted(models_root.rglob("*.py")):
            for imported, _, line in _imports(path, set()):
                if imported.split(".")[0] == package:
                    problems.append(f"{path.relative_to(models_root.parent)}:{line}: model code imports {imported}")
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules that import each other (depth-first search)."""
    cycles, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append([*stack[stack.index(target) :], target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    return cycles


def test_tp_train_imports_point_one_way():
    problems = import_problems(ROOT / "tp_train", ROOT / "models")
    assert not problems, "\n".join(problems)


def test_plan_decides_applies_and_checks_apart():
    problems = plan_job_problems(ROOT / "tp_train" / "plan")
    assert not problems, "\n".join(problems)


def test_the_job_checker_flags_deciding_that_reaches_into_applying(tmp_path):
    plan = tmp_path / "pkg" / "plan"
    sources = {
        "probe.py": "from pkg.plan.applying.apply import materialize\n",  # shared -> applying
        "deciding/autoplan.py": "from pkg.plan.checking.verify import first_tensor\nfrom pkg.plan.probe import x\n",
        "checking/verify.py": "from pkg.plan.checking.compare import first_tensor\n",  # its own job: fine
        "parallelize.py": "from pkg.plan.applying.apply import apply_plan\n",  # the entry runs the three
        "stray/helpers.py": "",
    }
    for relative, source in sources.items():
        (plan / relative).parent.mkdir(parents=True, exist_ok=True)
        (plan / relative).write_text(source)
    assert plan_job_problems(plan) == [
        "plan/stray/ is no job: its modules go in one of deciding, applying, checking, or in plan/ if all three "
        "use them",
        "plan/deciding/autoplan.py:1: deciding imports pkg.plan.checking.verify (checking)",
        "plan/probe.py:1: shared imports pkg.plan.applying.apply (applying)",
    ]


BROKEN_TREE = {
    "errors.py": "",
    "parallel/__init__.py": "",
    "parallel/layers.py": "from pkg.plan.apply import apply_plan\n",  # upward
    "plan/__init__.py": "",
    "plan/apply.py": "import lightning\nfrom pkg.parallel.layers import _private_helper\n",  # framework; private
    "plan/a.py": "from pkg.plan import b\n",
    "plan/b.py": "from pkg.plan.a import thing\n",  # a <-> b
    "tools/__init__.py": "",
    "tools/bench.py": "from pkg.lightning.strategy import Strategy\n",  # sideways
    "lightning/__init__.py": "",
    "lightning/strategy.py": "",
}


@pytest.mark.parametrize(
    "expected",
    [
        "parallel/layers.py:1: parallel/ imports pkg.plan.apply, a layer above or beside it (plan/)",
        "plan/apply.py:1: imports lightning below lightning/ and app/",
        "plan/apply.py:2: imports the private name _private_helper from pkg.parallel.layers",
        "import cycle: pkg.plan.a -> pkg.plan.b -> pkg.plan.a",
        "tools/bench.py:1: tools/ imports pkg.lightning.strategy (lightning/): the two never import each other",
        "models/gpt.py:1: model code imports pkg.parallel.layers",
    ],
)
def test_the_checker_flags_each_broken_rule(tmp_path, expected):
    for relative, source in BROKEN_TREE.items():
        path = tmp_path / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "gpt.py").write_text("import pkg.parallel.layers\n")
    problems = import_problems(tmp_path / "pkg", tmp_path / "models")
    assert any(problem.endswith(expected) or expected in problem for problem in problems), problems


# The parallel degrees, as the code names them (bare, as attributes, or read as cfg.get("tp")); only ParallelDims
# (tp_train/parallel/dims.py) multiplies or divides two of them (issue 53).
DEGREE_NAMES = {
    "tp", "cp", "pp", "dp", "ep", "world_size", "tensor_parallel_size", "context_parallel_size",
    "pipeline_parallel_size", "data_parallel_size", "expert_parallel_size", "dp_shard", "dp_replicate",
    "data_parallel_shard_size", "virtual_stages", "pipeline_virtual_stages", "num_stages", "devices", "num_nodes",
    "nodes",
}  # fmt: skip
DEGREE_OWNER = "parallel/dims.py"
PRODUCT_OPS = (ast.Mult, ast.FloorDiv, ast.Div, ast.Mod)  # a product, a quotient, or a divisibility check


def _degree_name(node: ast.AST) -> str | None:
    """The degree `node` reads (`tp`, `self.tensor_parallel_size`, `cfg.get("cp", 1)`), or None."""
    if isinstance(node, ast.Name):
        name = node.id
    elif isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        first = node.args[0]
        name = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
    else:
        return None
    return name.lower() if name.lower() in DEGREE_NAMES else None  # a module's constants too: DP * TP


def _factors(node: ast.AST) -> list[ast.AST]:
    """The operands of a chain of `*`, `/`, `//` and `%` (`a * (b // c)` -> a, b, c)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, PRODUCT_OPS):
        return _factors(node.left) + _factors(node.right)
    return [node]


def degree_product_problems(package_root: Path) -> list[str]:
    """Each chain of `*`, `/`, `//`, `%` with two or more degrees among its operands, outside `DEGREE_OWNER`; and
    each call of `init_device_mesh` there: the job's mesh is `ParallelDims.build_mesh`'s."""
    problems = []
    for path in sorted(package_root.rglob("*.py")):
        relative = path.relative_to(package_root).as_posix()
        if relative == DEGREE_OWNER:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        inner = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.BinOp) and isinstance(node.op, PRODUCT_OPS)
            for child in (node.left, node.right)
        }  # a chain is reported once, at its outermost operator
        chains = [node for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, PRODUCT_OPS)]
        for node in ast.walk(tree):
            called = getattr(node, "func", None) if isinstance(node, ast.Call) else None
            if getattr(called, "id", getattr(called, "attr", None)) == "init_device_mesh":
                problems.append(f"{relative}:{node.lineno}: a mesh built here; use ParallelDims.build_mesh")
        for node in sorted(chains, key=lambda node: (node.lineno, node.col_offset)):
            if id(node) not in inner:
                degrees = [name for name in map(_degree_name, _factors(node)) if name is not None]
                if len(degrees) >= 2:
                    problems.append(
                        f"{relative}:{node.lineno}: {' x '.join(degrees)} multiplied here; ask ParallelDims "
                        f"({DEGREE_OWNER}) for the size"
                    )
    return problems


def test_only_parallel_dims_multiplies_degrees():
    problems = degree_product_problems(ROOT / "tp_train")
    assert not problems, "\n".join(problems)


def test_the_degree_checker_flags_a_product_of_degrees(tmp_path):
    sources = {
        "parallel/dims.py": "def model_parallel(tp, cp, pp):\n    return tp * cp * pp\n",  # the owner may
        "plan/views.py": "def local(width, tp):\n    return width // tp\n",  # one degree: a shard's width
        "lightning/metrics.py": "def dp(trainer, tp):\n    return trainer.world_size // tp\n",
        "app/checks.py": "def fits(cfg, devices):\n    return devices % (cfg.tp * cfg.get('cp', 1) * 2)\n",
        "tools/bench/sizes.py": "DP, TP = 2, 2\nWORLD = DP * TP\n",  # a module's constants
        "tools/bench/checks.py": "def fits(world_size, tp):\n    return world_size % tp == 0\n",
        "tools/memory.py": "def sizes(dims, split):\n    return dims.dp_shard * dims.cp, split.num_stages // dims.pp\n",
        "app/generate.py": "import torch.distributed.device_mesh as dm\nmesh = dm.init_device_mesh('cpu', (2,))\n",
    }
    for relative, source in sources.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source)
    assert degree_product_problems(tmp_path) == [
        "app/checks.py:2: devices x tp x cp multiplied here; ask ParallelDims (parallel/dims.py) for the size",
        "app/generate.py:2: a mesh built here; use ParallelDims.build_mesh",
        "lightning/metrics.py:2: world_size x tp multiplied here; ask ParallelDims (parallel/dims.py) for the size",
        "tools/bench/checks.py:2: world_size x tp multiplied here; ask ParallelDims (parallel/dims.py) for the size",
        "tools/bench/sizes.py:2: dp x tp multiplied here; ask ParallelDims (parallel/dims.py) for the size",
        "tools/memory.py:2: dp_shard x cp multiplied here; ask ParallelDims (parallel/dims.py) for the size",
        "tools/memory.py:2: num_stages x pp multiplied here; ask ParallelDims (parallel/dims.py) for the size",
    ]


# What a branch on the data-parallel mode reads: the mode's name or values, or the wrappers that apply them.
DATA_PARALLEL_MARKS = ("data_parallel", "fsdp", "ddp", "FSDPModule", "DistributedDataParallel")
# The one module of lightning/ that looks at the pipeline: its step runner, chosen there once at setup.
PIPELINE_OWNER = "pipeline.py"


def _reads_data_parallel(word: str) -> bool:
    return word in DATA_PARALLEL_MARKS


def _reads_pipeline(word: str) -> bool:
    """The pipeline or its degree: `self._pipeline`, `training.pipeline`, `pipeline_parallel_size`, `dims.pp`, a stage
    it holds."""
    return "pipeline" in word.lower() or word in ("pp", "holds_first", "holds_last")


def branch_problems(lightning: Path, reads: Callable[[str], bool], what: str, owner: str | None = None) -> list[str]:
    """Each `if` (or conditional expression) in lightning/ outside `owner` whose test reads a name, attribute or
    string that `reads` marks, other than an argument's refusal (an `if` whose body only raises); and each `and` /
    `or` outside such a test that reads one (`x = wanted and pipeline_parallel_size == 1` decides as an `if` does)."""
    problems = []
    for path in sorted(lightning.rglob("*.py")):
        relative = path.relative_to(lightning).as_posix()
        if relative == owner:
            continue
        tree = ast.parse(path.read_text())
        tested = {
            id(leaf) for node in ast.walk(tree) if isinstance(node, (ast.If, ast.IfExp)) for leaf in ast.walk(node.test)
        }
        nested = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.BoolOp)
            for child in ast.walk(node)
            if child is not node
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.BoolOp):
                if id(node) in tested or id(node) in nested:
                    continue
            elif not isinstance(node, (ast.If, ast.IfExp)):
                continue
            elif isinstance(node, ast.If) and all(isinstance(statement, ast.Raise) for statement in node.body):
                continue
            test = node if isinstance(node, ast.BoolOp) else node.test
            read = {getattr(leaf, "id", None) or getattr(leaf, "attr", None) or getattr(leaf, "value", None)
                    for leaf in ast.walk(test)}  # fmt: skip
            if any(isinstance(word, str) and reads(word) for word in read):
                problems.append(f"lightning/{relative}:{node.lineno}: {what}")
    return problems


def data_parallel_branch_problems(lightning: Path) -> list[str]:
    """Branches on the data-parallel mode in lightning/: `tp_train.training`'s apply order owns that choice."""
    what = "a branch on the data-parallel mode; tp_train.training's apply order decides it"
    return branch_problems(lightning, _reads_data_parallel, what)


def pipeline_branch_problems(lightning: Path) -> list[str]:
    """Branches on the pipeline (whether there is one, its degree, its stages) in lightning/ outside `PIPELINE_OWNER`:
    the strategy's hooks call the step runner chosen there once at setup, the same way with or without a pipeline."""
    return branch_problems(
        lightning, _reads_pipeline, f"a branch on the pipeline; the step runner (lightning/{PIPELINE_OWNER}) runs it",
        owner=PIPELINE_OWNER,
    )  # fmt: skip


def test_lightning_does_not_branch_on_the_data_parallel_mode():
    problems = data_parallel_branch_problems(ROOT / "tp_train" / "lightning")
    assert not problems, "\n".join(problems)


def test_lightning_does_not_branch_on_the_pipeline_outside_its_step_runner():
    problems = pipeline_branch_problems(ROOT / "tp_train" / "lightning")
    assert not problems, "\n".join(problems)


def test_the_branch_checker_flags_a_branch_on_the_data_parallel_mode(tmp_path):
    (tmp_path / "strategy.py").write_text(
        "def setup(self):\n"
        "    if self.data_parallel == 'fsdp':\n        self.wrap()\n"  # flagged
        "    model = wrap(self.model) if isinstance(self.model, FSDPModule) else self.model\n"  # flagged
        "    if self.data_parallel not in MODES:\n        raise ValueError(self.data_parallel)\n"  # a refusal
    )
    assert data_parallel_branch_problems(tmp_path) == [
        "lightning/strategy.py:2: a branch on the data-parallel mode; tp_train.training's apply order decides it",
        "lightning/strategy.py:4: a branch on the data-parallel mode; tp_train.training's apply order decides it",
    ]


def test_the_branch_checker_flags_a_branch_on_the_pipeline_outside_its_owner(tmp_path):
    (tmp_path / "strategy.py").write_text(
        "def backward(self, loss):\n"
        "    if self._pipeline is None:\n        return super().backward(loss)\n"  # flagged
        "    scale = None if self.parallel_training.pipeline is None else 0.5\n"  # flagged
        "    if self.pipeline_parallel_size > 8:\n        raise ValueError('too many stages')\n"  # a refusal
        "    self.loss_parallel = loss_parallel and self.pipeline_parallel_size == 1\n"  # flagged
    )
    (tmp_path / "metrics.py").write_text(
        "def count(strategy, dims):\n"
        "    if getattr(strategy, 'pipeline_parallel_size', 1) == 1:\n        return 0\n"  # flagged
        "    if dims.pp > 1:\n        return 1\n"  # flagged
    )
    (tmp_path / PIPELINE_OWNER).write_text(  # the owner chooses the runner and runs the stages
        "def step_runner(training):\n"
        "    return ModelSteps() if training.pipeline is None else PipelineSteps(training.pipeline)\n"
    )
    assert pipeline_branch_problems(tmp_path) == [
        "lightning/metrics.py:2: a branch on the pipeline; the step runner (lightning/pipeline.py) runs it",
        "lightning/metrics.py:4: a branch on the pipeline; the step runner (lightning/pipeline.py) runs it",
        "lightning/strategy.py:2: a branch on the pipeline; the step runner (lightning/pipeline.py) runs it",
        "lightning/strategy.py:4: a branch on the pipeline; the step runner (lightning/pipeline.py) runs it",
        "lightning/strategy.py:7: a branch on the pipeline; the step runner (lightning/pipeline.py) runs it",
    ]
