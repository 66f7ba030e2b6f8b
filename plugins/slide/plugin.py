"""Hook implementations of the slide plugin.

``accelopt_layer_build`` swaps a job's wide output ``nn.Linear`` (>= ``min_width`` outputs)
for a :class:`SlideLinear` initialised from the same weights, and (``sparse_input``) the XC
network's sparse first layer for :class:`SlideSparseInput`. Both train with their own sparse
Adam, at the job's learning rate unless ``plugins.slide.lr`` says otherwise, scaled each
iteration by the job's ``lr_schedule`` and ``warmup_iterations`` as the core scales its
optimizer's (``accelopt_iteration_start``).

A weight the output layer shares with another module (GPT-2's ``lm_head`` is its input
embedding) stays shared: the SLIDE layer's weight buffer is that Parameter's storage, so the
output side (SLIDE's sparse Adam) and the input side (the job's optimizer) train one tensor.
SLIDE runs in one process only: its weights are buffers, which neither cluster mode trains
(see :data:`REFUSED_MODES`).
"""

from __future__ import annotations

import dataclasses
import weakref
from types import SimpleNamespace
from typing import Any

import numba
from accelopt_plugins.slide.config import SlideConfig, as_config, validate
from accelopt_plugins.slide.layer import SlideLinear, SlideSparseInput, unshareable
from accelopt_plugins.slide.xcmodel import SparseInput
from torch import fx, nn

from accelopt import ConfigError, JobInfo, LayerOffer, ReportRow, RunInfo, UserError, hookimpl
from accelopt.config import YOUR_LOOP_DATASET
from accelopt.job.optim import lr_factor, schedules
from accelopt.types import INERT, IterationContext

REFUSED_MODES = {
    "ps": "the parameter server exchanges parameters only, and SLIDE's weights are buffers "
          "trained by its own sparse Adam, so every worker would train its own copy",
    "allreduce": "DDP reduces parameter gradients only and broadcasts buffers from rank 0 "
                 "before every forward, so SLIDE's weights (buffers trained by its own sparse "
                 "Adam) would keep rank 0's updates and drop every other rank's",
}
"""Why each cluster mode would train SLIDE's layers wrongly (silently), hence refused.
Inference jobs do not run in a cluster at all (the core refuses them)."""


class LeftDense:
    """A wide layer SLIDE left dense, as its row names it. The width is read when the row is
    made, not at build: a plugin that runs after SLIDE's build (gpu_kernels' pruning) may cut
    the layer, and the row names the width the job trained (5000 read before, for a layer
    pruned to 2500), with the width SLIDE saw beside it where the two differ. The model and
    the layer are held weakly (a finished job's model is not kept alive for the row); where
    neither is still there the width SLIDE saw is all there is."""

    def __init__(self, label: str, why: str, module: nn.Module | None = None,
                 root: nn.Module | None = None, path: str = "") -> None:
        self.label = label
        self.why = why
        self.path = path
        self.built = int(getattr(module, "out_features", 0)) if module is not None else 0
        self._module = weakref.ref(module) if module is not None else None
        self._root = weakref.ref(root) if root is not None else None

    def width(self) -> int:
        """The layer's outputs now: the module at its path in the model (another plugin may
        have swapped it), else the module SLIDE saw, else its width then."""
        root = self._root() if self._root is not None else None
        found: list[Any] = []
        if root is not None:
            try:
                found.append(root.get_submodule(self.path) if self.path else root)
            except AttributeError:
                pass
        if self._module is not None:
            found.append(self._module())
        for mod in found:
            out = getattr(mod, "out_features", None)
            if isinstance(out, int):
                return out
        return self.built

    def __str__(self) -> str:
        if self._module is None:  # not a Linear (the sparse input layer): no width to give
            return f"{self.label} ({self.why})"
        now = self.width()
        outputs = (f"{now} outputs" if now == self.built
                   else f"{now} outputs as trained, {self.built} when SLIDE saw it")
        return f"{self.label} ({outputs}, {self.why})"


def cluster_mode(run_config: Any) -> str:
    """``cluster.mode`` of the run (``none`` when the run config has no cluster section,
    as in a loop of one's own)."""
    cluster = getattr(run_config, "cluster", None)
    return str(getattr(cluster, "mode", "none") or "none")


def cuda_device(run_config: Any) -> str | None:
    """``run.device`` when it puts the jobs on a GPU (``auto`` does where CUDA is), else
    ``None``: SLIDE's hashing and sparse kernels are CPU code."""
    name = str(getattr(getattr(run_config, "run", None), "device", "cpu") or "cpu")
    if name == "auto":
        import torch

        return "auto (CUDA on this machine)" if torch.cuda.is_available() else None
    return None if name.startswith("cpu") else name


class TieCheck:
    """A load-state-dict pre-hook of a model whose output layer SLIDE keeps tied: both names
    load into one storage, so a checkpoint in which they differ (saved untied) cannot be
    loaded faithfully; refused in one line instead of keeping whichever came last. A class,
    not a closure, so that the model still pickles and deep-copies."""

    def __init__(self, tied: str, weight: str) -> None:
        self.tied, self.weight = tied, weight

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict,
                 *_: Any) -> None:
        a, b = state_dict.get(prefix + self.tied), state_dict.get(prefix + self.weight)
        if a is None or b is None:
            return  # a partial state dict (strict=False): the one present fills the tie
        if a.data_ptr() == b.data_ptr():
            return  # saved tied: one tensor under both names
        if local_metadata.get("assign_to_params_buffers"):
            raise UserError(
                f"slide: load_state_dict(assign=True) would make {self.weight} and "
                f"{self.tied} two tensors, but this model keeps them tied; load without assign")
        if a.shape != b.shape or not bool((a == b).all()):
            raise UserError(
                f"slide: the state dict's {self.weight} differs from its {self.tied} (saved "
                f"untied?), but this model keeps the two tied (one tensor); give both entries "
                f"the weights wanted (copy one over the other) before loading")


SCHEDULE_KEYS = ("lr", "iterations", "warmup_iterations", "lr_schedule", "min_lr")
"""The job keys the core's learning-rate schedule reads (``accelopt.job.optim.lr_factor``)."""


def schedule_of(job: Any) -> SimpleNamespace | None:
    """The job's learning-rate schedule as ``lr_factor`` reads it, or ``None`` where its rate
    is constant (nothing to follow)."""
    spec = SimpleNamespace(**{k: getattr(job, k) for k in SCHEDULE_KEYS})
    if float(spec.lr) <= 0:  # no rate of its own to scale (refused or plugins.slide.lr)
        return None
    return spec if schedules(spec) else None  # type: ignore[arg-type]


SAMPLED_LOSS = ("the loss column is the sampled softmax's over each active set, lower than "
                "the full softmax's a dense run reports: compare the held-out column")
"""Why a SLIDE job's training loss is not comparable with a dense job's, for its row."""

LSH_HELD_OUT = ("the held-out column was scored with LSH inference (plugins.slide.inference="
                "lsh: only the retrieved neurons scored, -inf elsewhere), not with the dense "
                "layer, so it is not comparable with a dense-scored run's; set "
                "plugins.slide.inference=dense to score every output")
"""What a training row adds under ``inference=lsh``: the core scores held-out quality with
the model in eval mode, where the layer then returns LSH logits; a row that read like a
dense-scored run's showed P@1 0.757 for weights that score 0.900 densely."""

LSH_HELD_OUT_KEY = "heldout_lsh_inference"
"""The metrics key (1) of a training row whose held-out figure was scored with LSH."""


def thread_note(threads: int) -> str:
    """What the row says about ``plugins.slide.threads`` (nothing at 0, numba's default): the
    count the layers ran with, and that it was reduced where numba allows fewer
    (``NUMBA_NUM_THREADS``, the cores numba saw at import): ``threads=1000`` ran on that
    many, and a row saying nothing read as if 1000 had."""
    if not threads:
        return ""
    most = int(numba.config.NUMBA_NUM_THREADS)
    if threads <= most:
        return f"; {threads} numba thread{'s' * (threads > 1)} (plugins.slide.threads)"
    return (f"; {most} numba threads: plugins.slide.threads={threads} reduced to numba's "
            f"maximum here (NUMBA_NUM_THREADS={most})")


RESUMED = ("resumed at iteration {at}: the LSH tables and hash functions, the sparse Adam "
           "moments and step counts, and the rebuild schedule came back with the model (they "
           "are its buffers, in the checkpoint); this row's counters (active fraction, rows "
           "per batch, time shares, rebuilds) are this process's, so they cover only the "
           "iterations after the resume")
"""What a resumed job's SLIDE row says about its checkpoint: the core's generic note for a
plugin without ``accelopt_state_save`` ("keeps no state in checkpoints") read as if the
tables were lost, when every piece of the layers' state is a buffer and a resumed run
matches an uninterrupted one exactly; only the row's statistics restart."""


class _LeafTracer(fx.Tracer):
    """Every module without children is one call (SLIDE's own layers, a user's custom
    layers): only the path from the layers to the model's output matters here."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return next(m.children(), None) is None or super().is_leaf_module(m, qualname)


_PASS_THROUGH = ("view", "reshape", "float", "contiguous")
"""Methods on a layer's output that keep it the model's output (SlideLogits defines them)."""


def output_layers(model: nn.Module) -> tuple[set[str], str | None, dict[str, int]]:
    """Paths of the modules whose output is (part of) the model's output, why that is
    unsure (else None), and how many times the forward calls each module (empty when it
    cannot be traced). Why the calls: a wide layer used both as a hidden layer and as the
    output layer (called twice) cannot be SLIDE's, whose training output is sampled logits
    for the loss only. Why not the last module registered: a model that registers its
    output layer first (``self.out`` before ``self.inp``) had its wide *hidden* layer
    replaced, and the job failed on the sampled logits. Found by tracing the forward with
    torch.fx; a model fx cannot trace falls back to the last parameterised module
    registered (HF models, which register their head last), unless another layer reads as
    many features as that one outputs (then it may be hidden: unsure, left dense)."""
    try:
        graph = _LeafTracer().trace(model)
    except Exception:  # noqa: BLE001 - untraceable: the registration order decides
        return (*_last_registered(model), {})
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    found: set[str] = set()
    todo = list(next(n for n in graph.nodes if n.op == "output").all_input_nodes)
    while todo:
        node = todo.pop()
        if node.op == "call_module":
            found.add(str(node.target))
        elif node.op == "call_method" and node.target in _PASS_THROUGH:
            todo.append(node.args[0])  # type: ignore[arg-type]
        elif node.op == "call_function" and node.target in (tuple, list, dict):
            todo += node.all_input_nodes
    return found, None, calls


def _last_registered(model: nn.Module) -> tuple[set[str], str | None]:
    last = None
    for path, mod in model.named_modules():
        if path and any(True for _ in mod.parameters(recurse=False)) or isinstance(
                mod, SlideSparseInput):
            last = (path, mod)
    if last is None:
        return set(), None
    width = getattr(last[1], "out_features", None)
    readers = [p for p, m in model.named_modules()
               if m is not last[1] and getattr(m, "in_features", None) == width]
    if width is not None and readers:
        return set(), (f"cannot tell if it is the output layer: the model is not torch.fx-"
                       f"traceable and {readers[0]} reads as many features")
    return {last[0]}, None


ROOT_LABEL = "(the model)"
"""How a row names the layer of a model that is one Linear (its path is empty)."""


def frozen_in(module: nn.Module, kind: str) -> str | None:
    """Why a training job's layer stays dense because the user froze it (a parameter with
    ``requires_grad=False``), else None. SLIDE's layer trains every weight it holds with its
    own sparse Adam, in backward, outside the job's optimizer: a frozen head swapped in
    was trained all the same (a fine-tuned body's fixed head changed). An inference job
    trains nothing, so its frozen layer is still replaced (for LSH inference)."""
    if kind != "train":
        return None
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    return (f"frozen: {', '.join(frozen)} requires_grad=False, and SLIDE would train it "
            "with its own sparse Adam")


def names_of(model: nn.Module, mod: nn.Module) -> list[str]:
    """Every path under which ``model`` registers ``mod``, first name first: a head
    registered twice (``self.alias = self.head``) is one module with two names, and
    ``named_modules`` (and torch.fx) give only the first."""
    return [p for p, m in model.named_modules(remove_duplicate=False) if m is mod]


def own_forward(mod: nn.Module) -> str | None:
    """Why a wide ``nn.Linear`` subclass stays dense (else None): its class overrides
    ``forward`` (a cosine classifier, a scaled head), and SLIDE's layer computes
    ``x @ W.T + b`` only, so replacing it changed the model's outputs (by up to 10 for a
    cosine head, before any training)."""
    cls = type(mod)
    if cls is nn.Linear or cls.forward is nn.Linear.forward:
        return None
    return (f"{cls.__name__} subclasses nn.Linear with its own forward, which SLIDE's layer "
            "(x @ W.T + b) would not compute")


class SlidePlugin:
    """Replaces wide output layers at build time and reports what the layers did."""

    def __init__(self, config: Any) -> None:
        self.cfg: SlideConfig = as_config(config)
        self.job_lr: dict[str, tuple[str, float]] = {}
        self.lr_notes: dict[str, str] = {}
        """Per job: how its SLIDE layers' rate was chosen, where the row must say it."""
        self.layers: list[tuple[str, str, SlideLinear]] = []
        self.inputs: list[tuple[str, str, SlideSparseInput]] = []
        self.skipped: list[LeftDense] = []
        self.kinds: dict[str, str] = {}
        """Per job with a replaced layer: its kind (train or infer), for its row."""
        self.schedules: dict[str, SimpleNamespace] = {}
        """Per job whose learning rate changes over its iterations: its schedule, which the
        SLIDE layers follow (they step in backward, outside the job's optimizer)."""
        self.clips: dict[str, float] = {}
        """Per job with ``grad_clip``: the clip, which the SLIDE layers' rows do not get."""
        self.own_loops: set[str] = set()
        """Jobs of ``accelopt.attach``: the user's loop steps their optimizer, so a scheduler
        there never reaches the SLIDE layers (which update themselves, in backward)."""
        self.aliases: dict[tuple[str, str], str] = {}
        """(job, path) of a replaced layer registered under more names -> the row's note."""
        self.ties: dict[tuple[str, str], str] = {}
        """(job, path) of a replaced layer whose weight another module shared (GPT-2's tied
        embedding) -> what became of the tie, for its report row."""
        self.done: dict[str, int] = {}
        """Per job: the iterations it has started (the last index + 1), kept in its
        checkpoint (:meth:`accelopt_state_save`) so a resumed row can say where it resumed."""
        self.resumed: dict[str, int] = {}
        """Per job resumed from a checkpoint: the iteration it resumed at."""

    @hookimpl
    def accelopt_configure(self, config: Any, run_config: Any) -> None:
        self.cfg = as_config(config)
        validate(self.cfg)
        mode = cluster_mode(run_config)
        if mode != "none":
            why = REFUSED_MODES.get(mode, "SLIDE's layers train in one process")
            raise ConfigError(f"plugins.slide: cluster.mode={mode} would train SLIDE's layers "
                              f"wrongly: {why}; use cluster.mode=none")
        device = cuda_device(run_config)
        if device is not None:
            raise ConfigError(f"plugins.slide: run.device={device}, but SLIDE's kernels run on "
                              "the CPU (the technique is training without a GPU); add "
                              "run.device=cpu")
        for job in getattr(getattr(run_config, "workload", None), "jobs", None) or []:
            name = str(job.name)
            self.job_lr[name] = (str(job.optimizer), float(job.lr))
            schedule = schedule_of(job) if hasattr(job, "lr_schedule") else None
            if schedule is not None:
                self.schedules[name] = schedule
            if getattr(job, "grad_clip", None) is not None:
                self.clips[name] = float(job.grad_clip)
            if getattr(job, "dataset", None) == YOUR_LOOP_DATASET:
                self.own_loops.add(name)

    @hookimpl
    def accelopt_iteration_start(self, context: IterationContext) -> None:
        """Set the job's SLIDE layers to this iteration's rate. Why here: the layers update
        in backward, before the core sets the optimizer's rate for the step (after
        backward), so they compute the same factor of the same iteration themselves; with
        the rate fixed at build, a warm-up left the output layer at full rate from step 0."""
        self.done[context.job.name] = context.iteration + 1
        schedule = self.schedules.get(context.job.name)
        if schedule is None:
            return
        scale = lr_factor(schedule, context.iteration)  # type: ignore[arg-type]
        for job, _, lay in (*self.layers, *self.inputs):
            if job == context.job.name:
                lay.lr_scale = scale

    @hookimpl
    def accelopt_state_save(self, job: JobInfo) -> dict[str, Any] | None:
        """The iterations the job has run, and nothing else: the layers' whole state (tables,
        hash functions, Adam moments, schedule) is buffers of the model, which the checkpoint
        holds already. Implemented so the resumed row can say so itself (:data:`RESUMED`)."""
        if not any(j == job.name for j, _, _ in (*self.layers, *self.inputs)):
            return None
        return {"iterations": self.done.get(job.name, 0)}

    @hookimpl
    def accelopt_state_load(self, job: JobInfo, state: dict[str, Any]) -> None:
        self.resumed[job.name] = int(state.get("iterations", 0))
        self.done[job.name] = self.resumed[job.name]

    def _lr(self, job_name: str, kind: str = "train") -> float:
        if self.cfg.lr is not None:
            return float(self.cfg.lr)
        if kind != "train":
            return 1e-3  # an inference job never updates weights
        optimizer, lr = self.job_lr.get(job_name, ("?", 0.0))
        if optimizer == "adamw":  # Adam's update; only the decoupled weight decay differs
            self.lr_notes[job_name] = (f"job '{job_name}' uses adamw: its SLIDE layer trains with "
                                       f"SLIDE's sparse Adam at the job's lr {lr:g}, without "
                                       "the decoupled weight decay")
            return lr
        if optimizer != "adam":
            raise ConfigError(
                f"plugins.slide.lr: job '{job_name}' uses optimizer {optimizer!r}; SLIDE trains "
                "with Adam, so set the job's optimizer to adam (or adamw) or give "
                "plugins.slide.lr=<rate>"
            )
        if lr <= 0:  # accelopt.attach without lr=: its layer would train at rate 0
            raise ConfigError(
                f"plugins.slide.lr: job '{job_name}' gives no learning rate (lr {lr:g}); SLIDE "
                "trains its layer at the job's: give the job its lr (accelopt.attach(..., "
                "lr=<rate>)) or plugins.slide.lr=<rate>")
        return lr

    @hookimpl
    def accelopt_layer_build(self, layer: LayerOffer) -> Any | None:
        module = layer.module
        if layer.path == "":  # the root comes last: now the output layer is known
            return self._replace_output(module, layer)
        if self.cfg.sparse_input and isinstance(module, SparseInput):
            frozen = frozen_in(module, layer.job.kind)
            if frozen:
                self.skipped.append(LeftDense(f"{layer.job.name}:{layer.path}",
                                              f"sparse input, {frozen}"))
                return None
            new_in = SlideSparseInput(module.weight, module.bias, self.cfg,
                                      lr=self._lr(layer.job.name, layer.job.kind))
            self.inputs.append((layer.job.name, layer.path, new_in))
            self.kinds[layer.job.name] = str(layer.job.kind)
            return new_in
        return None

    def _replace_output(self, model: nn.Module, layer: LayerOffer) -> nn.Module | None:
        """Replace the wide Linear whose output is the model's output (:func:`output_layers`):
        only an output layer may return SLIDE's deferred logits (a wide hidden layer stays
        dense, and so does every wide layer when the output layer cannot be told). A model
        that is one wide Linear (softmax regression) is its own output layer: the SLIDE
        layer returned replaces the root (it was left dense as "not the output layer")."""
        if isinstance(model, nn.Linear):
            return self._replace_root(model, layer)
        outputs, unsure, calls = output_layers(model)
        job = layer.job.name
        for path, mod in list(model.named_modules()):
            if not (isinstance(mod, nn.Linear) and mod.out_features >= self.cfg.min_width):
                continue
            names = names_of(model, mod)
            times = max((calls.get(n, 0) for n in names), default=0)
            why = own_forward(mod)
            if why is None and times > 1:
                why = (f"called {times} times in the forward: SLIDE's training output is "
                       "sampled logits for the loss only, so its layer can be called once, "
                       "as the output layer")
            if why is None and not any(n in outputs for n in names):
                why = unsure or ("not the output layer: the model does not return its "
                                 "output unchanged")
            if why is None:
                why = frozen_in(mod, layer.job.kind)
            if why:
                self.skipped.append(LeftDense(f"{job}:{path}", why, mod, model, path))
                continue
            tied_to = self._tie(model, job, names, mod)
            new = SlideLinear.from_linear(mod, self.cfg, lr=self._lr(job, layer.job.kind),
                                          tied_to=tied_to)
            for name_path in names:  # every name: the forward may call any of them
                parent_path, _, name = name_path.rpartition(".")
                setattr(model.get_submodule(parent_path), name, new)
            if len(names) > 1:
                self.aliases[(job, path)] = (f"also registered as {', '.join(names[1:])}: "
                                             "replaced under every name")
            if tied_to is not None:
                model.register_load_state_dict_pre_hook(TieCheck(tied_to, f"{path}.weight"))
            self.layers.append((job, path, new))
            self.kinds[job] = str(layer.job.kind)
        return None

    def _replace_root(self, model: nn.Linear, layer: LayerOffer) -> nn.Module | None:
        """The SLIDE layer for a model that is one Linear, if wide and trainable (else
        None, and a frozen one is named in the row); no other module can share its weight."""
        job, label = layer.job.name, ROOT_LABEL
        if model.out_features < self.cfg.min_width:
            return None
        why = own_forward(model) or frozen_in(model, layer.job.kind)
        if why:
            self.skipped.append(LeftDense(f"{job}:{label}", why, model, model, ""))
            return None
        new = SlideLinear.from_linear(model, self.cfg, lr=self._lr(job, layer.job.kind))
        self.layers.append((job, label, new))
        self.kinds[job] = str(layer.job.kind)
        return new

    def _tie(self, model: nn.Module, job: str, names: list[str], mod: nn.Linear
             ) -> str | None:
        """The name of the Parameter outside the layer (under any of its ``names``) that is
        ``mod``'s weight, if the SLIDE layer can share its storage (else the layer is
        untied, and its row says why)."""
        path = names[0]
        tied = [n for n, p in model.named_parameters(remove_duplicate=False)
                if p is mod.weight and not any(n.startswith(a + ".") for a in names)]
        if not tied:
            return None
        why = unshareable(mod.weight)
        if why:
            self.ties[(job, path)] = (f"untied from {tied[0]}, whose storage SLIDE cannot "
                                      f"share ({why}): the two now train separately")
            return None
        self.ties[(job, path)] = (f"kept tied to {tied[0]} (one tensor: SLIDE's sparse "
                                  "Adam updates the output side, the job's optimizer the input "
                                  "side)")
        return tied[0]

    def _method(self) -> str:
        """What trains the layer, as its row names it: ``sampling=random`` is the ablation
        (a sampled softmax of uniform negatives: no hashing, no tables)."""
        if self.cfg.sampling == "random":
            return (f"a sampled softmax (sampling=random: labels plus uniform random neurons "
                    f"to {self.cfg.min_active}, no LSH)")
        return f"LSH-sampled softmax ({self.cfg.hash} K={self.cfg.k} L={self.cfg.l})"

    @hookimpl
    def accelopt_report_rows(self, run: RunInfo) -> list[ReportRow]:
        # the widths are read now: a plugin after SLIDE's build may have pruned the layers
        left = ", ".join(map(str, self.skipped))
        if not self.layers:
            why = (f"no layer replaced; wide layers left dense: {left}"
                   if self.skipped else f"no output Linear layer has >= {self.cfg.min_width} "
                   "outputs (plugins.slide.min_width)")
            return [ReportRow(plugin="slide", summary=f"nothing to do on this workload: {why}",
                              metrics={INERT: 1})]
        rows = []
        for job, path, lay in self.layers:
            s = lay.summary()
            notes = "".join(f"; {d[(job, path)]}" for d in (self.aliases, self.ties)
                            if (job, path) in d)
            notes += thread_note(self.cfg.threads)
            if job in self.resumed:
                notes += f"; {RESUMED.format(at=self.resumed[job])}"
            if self.kinds.get(job) == "infer":
                rows.append(self._inference_row(job, path, lay, notes))
                continue
            notes += f"; {self.lr_notes[job]}" if job in self.lr_notes else ""
            notes += self._step_notes(job)
            lsh = {LSH_HELD_OUT_KEY: 1.0} if self.cfg.inference == "lsh" else {}
            if not lay.stats.get("samples"):  # the job failed (or never ran) before a batch
                rows.append(ReportRow(
                    plugin="slide",
                    summary=(f"{job}:{path} {lay.out_features} outputs replaced for "
                             f"{self._method()}, but no batch ran through it (the job failed "
                             f"or did not run: see its status){notes}"),
                    metrics={"samples": 0}))
                continue
            only = s["label_only_fraction"]
            if only >= 1:  # no sample had a negative: the layer learned nothing
                rows.append(ReportRow(
                    plugin="slide",
                    summary=(f"{job}:{path} {lay.out_features} outputs NOT trained: under "
                             f"{self._method()} every sample's active set was only its "
                             f"labels (no negative: a zero loss, nothing learned); "
                             f"{self._label_fix()}{notes}"
                             + (f"; {LSH_HELD_OUT}" if lsh else "")),
                    metrics={**{k: round(float(v), 6) for k, v in s.items()}, **lsh}))
                continue
            if only > 0:
                notes = (f"; WARNING: {100 * only:.1f}% of samples had only their labels "
                         f"active (no negative: a zero loss, nothing learned from them); "
                         f"{self._label_fix()}") + notes
            rows.append(ReportRow(
                plugin="slide",
                summary=(
                    f"{job}:{path} {lay.out_features} outputs trained with {self._method()}: "
                    f"{100 * s['active_fraction']:.2f}% active per sample, "
                    f"{s['union_rows_per_batch']:.0f} rows updated per batch, "
                    f"{100 * s['rebuild_time_share']:.1f}% of layer time building and "
                    "rebuilding tables"
                    + (f"; sparse-input first layer: {len(self.inputs)} replaced"
                       if self.inputs else "")
                    + f"; {SAMPLED_LOSS}" + (f"; {LSH_HELD_OUT}" if lsh else "") + notes
                ),
                metrics={**{k: round(float(v), 6) for k, v in s.items()}, **lsh},
            ))
        for i, (job, _, _) in enumerate(self.layers):  # one row per layer, in order
            if job in self.resumed:  # the key the core gives a row that counts from a resume
                rows[i] = dataclasses.replace(rows[i], metrics={
                    **rows[i].metrics, "since_resume_at": self.resumed[job]})
        if self.skipped:  # beside replaced layers too: a wide layer left dense is news
            rows.append(ReportRow(plugin="slide",
                                  summary=f"wide layers left dense: {left}",
                                  metrics={"left_dense": len(self.skipped)}))
        return rows

    def _label_fix(self) -> str:
        """The setting that gives samples whose active set was only their labels some
        negatives (the row's warning names it)."""
        if self.cfg.sampling == "threshold":
            return "lower plugins.slide.threshold or raise plugins.slide.min_active"
        return "raise plugins.slide.min_active"

    def _step_notes(self, job: str) -> str:
        """What the row says about how the job's step reaches its SLIDE layers: the rate
        schedule they follow, and a ``grad_clip`` they do not get (they update in backward,
        before the core clips, from a sampled gradient the clip's norm never sees)."""
        notes = ""
        if job in self.schedules:
            sch = self.schedules[job]
            notes += (f"; its sparse Adam follows the job's lr_schedule={sch.lr_schedule} "
                      f"(warmup_iterations={sch.warmup_iterations})")
        if job in self.own_loops:
            notes += (f"; its sparse Adam runs at lr {self._lr(job):g} throughout: a "
                      "scheduler of your loop changes your optimizer's rate only "
                      "(plugins.slide.lr sets the layer's)")
        if job in self.clips:
            notes += (f"; grad_clip={self.clips[job]:g} clips the job's other parameters "
                      "only: the SLIDE layer's sampled gradient is applied unclipped, and "
                      "not counted in the clipped norm")
        return notes

    def _inference_row(self, job: str, path: str, lay: SlideLinear, notes: str) -> ReportRow:
        """An inference job's row: the rows it scored (its layer never trains: no active
        sets, no rows updated)."""
        rows = int(lay.stats.get("inferred", 0))
        how = ("LSH: only the retrieved neurons are scored, -inf elsewhere "
               "(plugins.slide.inference=lsh)" if self.cfg.inference == "lsh" else
               "dense logits (plugins.slide.inference=dense: the layer computes every "
               "output in inference)")
        if not rows:
            summary = (f"{job}:{path} {lay.out_features} outputs replaced for inference, but "
                       "no batch ran through it (the job failed or did not run: see its "
                       "status)")
        else:
            summary = (f"{job}:{path} {lay.out_features} outputs, inference job: {rows} rows "
                       f"scored with {how}")
        return ReportRow(plugin="slide", summary=summary + notes,
                         metrics={"inferred_rows": rows})
