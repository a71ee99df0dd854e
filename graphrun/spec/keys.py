"""The pipeline spec, version 1: the single source of truth for keys, defaults and docs.

schemas/pipeline.schema.json and docs/spec.md's key table are generated from these models.
Per-field rules live here (the generate: section's in spec/generate.py); rules that tie several
keys together live in spec/rules.py, and YAML loading with line/column tracking in spec/load.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator,
                      model_validator)

from graphrun.base import dtypes
from graphrun.spec.base import Size, Strict, Text, Whole
from graphrun.spec.generate import (GENERATE_DOC, GENERATE_MAX_GRAPHS,
                                     IMPLIED_SECTIONS_SCHEMA, GenerateSpec)

FLOAT_DTYPES = dtypes.FLOAT
INT_DTYPES = dtypes.INT
DTYPES = dtypes.ALL

DType = Literal["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
                "uint8", "bool"]
ModelDType = Literal["float32", "float16", "bfloat16"]
Dim = Union[Size, str]
# A bucket axis: a list of sizes, or "auto". The discriminator keeps a bad list's error to the
# list's own (not a second "or it must be 'auto'"); the tags are the ones spec_load drops.
class _BucketKind:
    """The discriminator; its repr names it stably in docs/spec.md's generated key table."""

    def __call__(self, v: Any) -> str:
        return "str" if isinstance(v, str) else "list[int]"

    __name__ = "list_or_auto"

    def __repr__(self) -> str:
        return "list-or-auto"


BucketValues = Annotated[
    Union[Annotated[list[Size], Tag("list[int]")], Annotated[Literal["auto"], Tag("str")]],
    Discriminator(_BucketKind())]

BATCH = "batch"
MAX_GRAPHS = 8  # buckets_max_graphs of a forward-pass spec: the product of the lists


class HFModelSpec(Strict):
    """A Hugging Face transformers model from a local folder or the local cache (never
    downloaded)."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True,
                              serialize_by_alias=True)

    path: Text = Field(..., min_length=1, description="A folder holding config.json and the "
                      "weights (relative to the spec's folder), a cached hub name such as "
                      "'sentence-transformers/all-MiniLM-L6-v2', or pkg://PACKAGE/SUBFOLDER: a "
                      "folder inside an installed Python package.")
    class_: Text = Field("AutoModel", alias="class", description="The transformers class that "
                        "loads it: any Auto class (AutoModel, AutoModelForCausalLM, "
                        "AutoModelForSequenceClassification, ...) or a model class name.")
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped in the model folder. Off unless set.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="More keyword arguments "
                                   "for from_pretrained (e.g. attn_implementation: sdpa).")
    implementation: Literal["auto", "graphrun", "transformers"] = Field(
        "auto", description="Whose model code runs the folder's weights. graphrun: its own, "
        "which needs no transformers import: a BERT encoder (class AutoModel or BertModel) or "
        "sequence classifier (AutoModelForSequenceClassification), or for generation a "
        "Llama, Mistral, Qwen2, Qwen3 or GPT-2 causal LM, saved as safetensors. "
        "transformers: the class above. auto: graphrun's where it loads the folder as "
        "transformers would, else transformers' (the manifest's environment.model_code says "
        "which ran, and why).")


class TimmModelSpec(Strict):
    """A timm vision model by name; seeded random weights unless model.weights is given."""

    name: Text = Field(..., min_length=1, description="timm model name, e.g. resnet18.")
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for "
                                 "timm.create_model (num_classes, in_chans, ...).")
    seed: Whole = Field(0, description="Seed of the random weights.")


# Named here so that a spec is checked without importing torch or the readers (tested equal):
# the builtin models and the job each serves (models/builtins.py's table)
BUILTIN_JOBS = {"mlp": "forward", "decoder": "forward", "llama": "generate"}
BUILTIN_NAMES = tuple(n for n, job in BUILTIN_JOBS.items() if job == "forward")
GENERATE_BUILTINS = tuple(n for n, job in BUILTIN_JOBS.items() if job == "generate")
INPUT_SUFFIXES = (".jsonl", ".npy", ".npz", ".parquet")  # read/formats/'s readers


class ModelSpec(Strict):
    """Where the model comes from and how it is prepared. Exactly one source."""

    builtin: Optional[Text] = Field(
        None, description="A reference model shipped in graphrun: mlp or decoder; with "
        "generate:, llama (a Llama-layout causal LM, configured by args).")
    target: Optional[Text] = Field(
        None, description='"package.module:callable" returning an nn.Module, called with `args`; '
        "modules beside the spec are importable. Built as your own code builds it, on the CPU "
        "(its random init from the CPU generator, so a seeded builder gives the same values), "
        "then moved to the device; with model.weights its parameters are made without values "
        "and read from the file.")
    exported: Optional[Path] = Field(
        None, description="A torch.export archive (.pt2), relative to the spec's folder.")
    torchscript: Optional[Path] = Field(
        None, description="A TorchScript file (.pt), relative to the spec's folder.")
    hf: Optional[HFModelSpec] = Field(
        None, description="A Hugging Face transformers model (needs the hf extra).")
    timm: Optional[TimmModelSpec] = Field(
        None, description="A timm vision model by name (needs timm).")
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the builtin or target builder.")
    weights: Optional[Path] = Field(
        None, description="Optional state dict loaded into the model: .pt (weights_only) or "
        ".safetensors, relative to the spec's folder.")
    dtype: ModelDType = Field("float32", description="Parameter dtype of the model.")
    compile: bool = Field(
        False, description="torch.compile the model (its own CUDA graphs off) before graphrun "
        "captures it. A generation spec compiles its prefill and decode steps with dynamic shapes "
        "(a compilation per kind, not per bucket); a graph whose compilation fails or disagrees "
        "with the plain model is set up without it (generation.graphs[].compiled, reason).")
    call: Literal["keyword", "positional"] = Field(
        "keyword", description="keyword: model(name=tensor, ...); positional: model(t1, t2, ...) "
        "in the order the inputs are listed (usual for exported and TorchScript models).")
    allow_missing: list[Text] = Field(
        default_factory=list, description="Tensors the saved weights (model.hf's folder or "
        "model.weights) may lack, by name or glob (e.g. 'pooler.*', a head the outputs do not "
        "use); they keep their initial values. Any other missing, unexpected, reshaped or "
        "retyped tensor is an error before any work.")


class InputSpec(Strict):
    """One static input buffer. Names in `shape` are bucket axes; integers are fixed sizes."""

    shape: list[Dim] = Field(
        ..., min_length=1, description="Dimensions; the first must be `batch`. A name is a "
        "bucket axis, an integer a fixed size.")
    dtype: DType = Field("float32", description="Element type of the buffer.")
    range: Optional[tuple[float, float]] = Field(
        None, description="Integer inputs only: allowed values lo <= x < hi, checked on the host "
        "before the copy (an out-of-range index on the GPU kills the CUDA context).")
    pad: float = Field(0, description="Value written into padded rows and padded positions.")
    finite: bool = Field(False, description="Float inputs: reject records holding NaN or Inf.")


ReduceOp = Literal["mean_pool", "cls_pool", "last_pool", "l2_normalize", "softmax",
                   "log_softmax", "argmax"]


class TopKSpec(Strict):
    """The k largest values along the last axis, largest first."""

    k: Size = Field(..., description="How many.")
    take: Literal["ids", "values"] = Field(
        "ids", description="ids: their positions (int64, e.g. class or token ids); values: "
        "the values themselves.")


class OutputSpec(Strict):
    """How one of the model's returns is named, picked, reduced, unpadded and stored."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True,
                              serialize_by_alias=True)

    shape: list[Dim] = Field(
        ..., min_length=1, description="Dimensions; the first must be `batch`. Axes other than "
        "batch are cut back to each record's own length.")
    dtype: Optional[DType] = Field(
        None, description="Cast to this dtype when written (inside the captured step where "
        "from/reduce/topk are used); null keeps the model's dtype.")
    from_: Optional[Union[str, int]] = Field(
        None, alias="from", description="The field of the model's return this output is made "
        "from: a key or attribute (last_hidden_state, logits, pooler_output) or a tuple "
        "position. Setting from, reduce or topk computes the outputs inside the captured step.")
    reduce: list[ReduceOp] = Field(
        default_factory=list, description="Steps applied in order, inside the captured step: "
        "mean_pool (mean over seq where the mask is 1), cls_pool (position 0), last_pool (the "
        "last position where the mask is 1), l2_normalize, softmax, log_softmax (last axis), "
        "argmax (last axis; must come last).")
    topk: Optional[TopKSpec] = Field(
        None, description="After reduce: the top k along the last axis (ids or values).")
    mask: Text = Field(
        "attention_mask", min_length=1, description="The input holding the [batch, seq] mask "
        "(1 real, 0 padding) that mean_pool and last_pool use.")

    @property
    def reduced(self) -> bool:
        """Computed by the heads wrapper (models/heads.py) rather than named as returned."""
        return self.from_ is not None or bool(self.reduce) or self.topk is not None

    @property
    def picks_ids(self) -> bool:
        """Its values are positions chosen by argmax or top-k, not computed numbers."""
        if self.topk is not None:
            return self.topk.take == "ids"
        return bool(self.reduce) and self.reduce[-1] == "argmax"

    @field_validator("reduce")
    @classmethod
    def _argmax_last(cls, v: list[str]) -> list[str]:
        if "argmax" in v[:-1]:
            raise ValueError("argmax must be the last step (it turns values into ids)")
        return v


class VerifySpec(Strict):
    """Replay-against-eager check run once per bucket before it is trusted."""

    enabled: bool = Field(True, description="Check replay == eager and padding per captured "
                          "bucket: padded rows must not move real rows, and a record padded "
                          "along the other axes must give its outputs unpadded.")
    eager: bool = Field(False, description=(
        "Also check the buckets that run eagerly (the eager backend, e.g. the CPU), where there "
        "is no replay: the model gives the same outputs twice and padded rows do not move real "
        "rows, at one eager run more per bucket. false: an eager bucket gets no warm-up and no "
        "check (the manifest's reason says so)."))
    positions: bool = Field(True, description=(
        "Check padded positions on each bucket's first lane: its first rows, padded past half "
        "of every axis but batch with their inputs' pad value, must give the outputs the model "
        "gives them unpadded (called eagerly at that length). false: not checked, for a model "
        "whose inputs the check's random values misread (a length input pointing past a "
        "record's own length)."))
    rtol: float = Field(1e-3, ge=0, description="Relative tolerance.")
    atol: float = Field(1e-3, ge=0, description=(
        "Absolute tolerance. bfloat16 and float16 outputs get 2 units of their precision at "
        "the output's largest magnitude on top (capture may pick kernels that round "
        "differently)."))
    picked_rows: float = Field(0.05, ge=0, le=1, description=(
        "For outputs of picked ids (reduce: argmax, topk take: ids), which rtol/atol cannot "
        "judge: the share of a batch's rows whose ids may differ between replay and eager "
        "(at least one row). Where scores tie within rounding, kernels chosen under capture "
        "can swap a pick; a wrong graph changes nearly every row."))


def allowed_picks(share: float, rows: int) -> int:
    """Rows of `rows` whose picked ids may differ under capture.verify.picked_rows = share."""
    return max(1, math.floor(share * rows))


class CaptureSpec(Strict):
    """How graphs are captured."""

    backend: Literal["auto", "cuda-graph", "eager"] = Field(
        "auto", description="auto: cuda-graph on a CUDA device, eager elsewhere.")
    warmup_iters: Whole = Field(3, ge=0, description="Eager runs per bucket on a side stream "
                              "before capture.")
    pool: Literal["shared", "per-graph"] = Field(
        "shared", description="shared: one memory pool for all graphs (captured largest first); "
        "per-graph: a pool each.")
    verify: VerifySpec = Field(default_factory=VerifySpec)
    on_failure: Literal["error", "eager"] = Field(
        "error", description="When a bucket cannot be captured or fails verification: stop, or "
        "run that bucket eagerly (recorded in the manifest).")
    memory_budget_mib: Optional[float] = Field(
        None, gt=0, description="Drop the largest buckets whose capture would exceed this many "
        "MiB, instead of running out of memory. `graphrun plan` and `buckets: auto` plan "
        "within it (the batch values capped by an estimate from one measured bucket).")
    lazy: bool = Field(
        True, description="true: set up (warm up, capture, verify) at start only the buckets "
        "the input's batches select, as far as the run knows before streaming: the planner's "
        "histogram when buckets: auto ran, and the batches the reader holds by then (at least 4, "
        "or with data.group_by_length the first window's; more where it read on during setup, "
        "within GRAPHRUN_READ_AHEAD_BYTES: once those buckets are set up, the batches it read "
        "meanwhile are looked at again and theirs set up too). A bucket "
        "first selected later is set up when that batch comes: the launching thread waits for "
        "the batches in flight, captures and verifies the bucket on every lane, then goes on "
        "(the phase `bucket setup on first use`); where that fails and capture.on_failure is "
        "error, the run stops naming the bucket and the batch, the batches before it "
        "committed. Buckets no batch selects are "
        "never set up (status unused). The manifest says which were set up when "
        "(buckets[].set_up, first_use_batch). A Runner built directly (the Python API) sets "
        "up each bucket on its first batch. graphrun bench and plan's measurements set up "
        "every bucket whatever this says; graphrun sweep does unless --set or --grid gives "
        "capture.lazy. false: every bucket at start, so a capture or verification failure "
        "shows before any output.")


class TextSpec(Strict):
    """A text field tokenized into the model's inputs as the records are read."""

    field: Union[Text, list[Text]] = Field(
        "text", description="The JSONL field or Parquet column holding each record's text "
        "(with generate:, its prompt's text or its token ids, taken as they are); or a list of "
        "two, [query, passage], for a pair of texts tokenized together as the tokenizer's text "
        "pairs (a cross-encoder: [CLS] query [SEP] passage [SEP]).")
    tokenizer: Optional[Text] = Field(
        None, description="A folder with tokenizer.json (a fast tokenizer), as model.hf.path "
        "is written; null: the model's own (model.hf.path).")
    truncate: Optional[bool] = Field(
        None, description="true: cut longer texts to max_length tokens (with generate:, from "
        "the left, keeping the prompt's end); false: reject them (on_bad_record says whether "
        "the run stops). null: false with generate: (a prompt cut would lose its start "
        "unseen), true for a forward pass.")
    add_special_tokens: bool = Field(
        True, description="true: the tokenizer adds its special tokens (BOS, [CLS]/[SEP]) as "
        "transformers' tokenizer(text) does; false: the text already holds them (a chat "
        "template rendered by hand), so none is added a second time. data.chat sets false.")
    max_length: Optional[Size] = Field(
        None, description="Tokens per record at most; null: the largest seq bucket (or the "
        "tokenizer's model_max_length when seq is auto).")

    @field_validator("field", mode="before")
    @classmethod
    def _names(cls, v):
        if isinstance(v, list) and all(isinstance(n, str) for n in v) or isinstance(v, str):
            return v
        got = next((n for n in v if not isinstance(n, str)), v) if isinstance(v, list) else v
        raise ValueError(f"give a field's name, or a list of two names for a pair ([query, "
                         f"passage]); got {got!r}")

    @field_validator("field")
    @classmethod
    def _one_or_a_pair(cls, v):
        names = [v] if isinstance(v, str) else v
        if not 1 <= len(names) <= 2:
            raise ValueError(f"names {len(names)} fields; give one field (a text) or a list "
                             "of two (a pair of texts, e.g. [query, passage])")
        if any(not n for n in names):
            raise ValueError("a field name is empty")
        if len(set(names)) != len(names):
            raise ValueError(f"names {names[0]!r} twice; a pair is two different fields")
        return v

    @property
    def fields(self) -> list[str]:
        """The field read (one), or the pair's two fields, in their order."""
        return [self.field] if isinstance(self.field, str) else list(self.field)

    @property
    def pair(self) -> bool:
        return len(self.fields) == 2

    @property
    def named(self) -> str:
        """The field, or the pair, as a message names it."""
        return self.fields[0] if not self.pair else "[" + ", ".join(self.fields) + "]"


class ChatSpec(Strict):
    """Chat records: each holds an OpenAI message list, rendered into its prompt by the model's
    chat template."""

    field: Text = Field("messages", description="The JSONL field (or Parquet column) holding "
                        "each record's messages: [{role: system|user|assistant, content: a "
                        "string or a list of {type: text, text: ...} parts}, ...].")
    template: Optional[Text] = Field(
        None, description="A file holding a Jinja chat template, relative to the spec's folder; "
        "null: the tokenizer's own (tokenizer_config.json's chat_template, or "
        "chat_template.jinja beside it).")


class DataSpec(Strict):
    """The input file and how it is batched."""

    path: Path = Field(..., description=".jsonl, .npy, .npz or .parquet, relative to the spec's "
                       "folder.")
    id_field: Optional[Text] = Field(
        None, min_length=1, description="Field (or .npz array / Parquet column) holding record "
        "ids; otherwise a record's position is its id.")
    batch_size: Size = Field(32, description="Records per batch.")
    oversize: Literal["split", "eager", "error"] = Field(
        "split", description="For a batch larger than every batch bucket: split it across "
        "buckets, run it eagerly, or stop.")
    on_bad_record: Literal["error", "skip"] = Field(
        "error", description="error: stop at the first bad record; skip: write it to "
        "rejects.jsonl with the reason and go on.")
    group_by_length: Optional[Size] = Field(
        None, description="Sort each window of this many consecutive records (input order) by "
        "length on the variable bucket axes (e.g. seq; for text input, the token count) and "
        "batch within it, so that similar lengths share a batch and pad less. Outputs are "
        "still written in input order with their ids; a window's outputs are held until the "
        "window is complete (memory: about one window of inputs and one of outputs). "
        "--resume restarts at the window holding the first uncommitted record. null: off.")
    text: Optional[TextSpec] = Field(
        None, description="Tokenize a text field into the inputs input_ids, attention_mask and "
        "token_type_ids (those the spec lists), with the model's fast tokenizer (needs "
        "the hf extra).")
    chat: Optional[ChatSpec] = Field(
        None, description="Chat records: the prompt is the record's messages rendered by the "
        "model's chat template (add_generation_prompt), tokenized without adding special "
        "tokens again. Implies generate: (its defaults) and data.text (its field the messages', "
        "add_special_tokens false); data.text may still set truncate, max_length, tokenizer.")
    format: Optional[Literal["openai_batch"]] = Field(
        None, description="openai_batch: a JSONL file of OpenAI Batch API requests (custom_id, "
        "method POST, url /v1/chat/completions or /v1/completions, body with messages or "
        "prompt and the request's parameters), each request's parameters its own. Implies "
        "generate:, id_field custom_id, and data.text (field body). null: by the file's "
        "suffix.")


class OutputConfig(Strict):
    """Where and how outputs are written."""

    dir: Path = Field(..., description="Output folder, relative to the spec's folder.")
    format: Literal["npy", "jsonl", "parquet", "openai_batch"] = Field(
        "npy", description="Shard format. openai_batch (a generation job): JSONL lines as the "
        "OpenAI Batch API writes them ({id, custom_id, response: {status_code, request_id, "
        "body: a chat.completion or text_completion}, error}). Left out in a generation "
        "job: jsonl (openai_batch for an OpenAI Batch file).")
    rows_per_file: Optional[Size] = Field(
        None, description="Records per output shard. null: as many as make about 64 MiB of "
        "outputs (from the outputs' shapes and dtypes, an axis at its largest bucket), a "
        "multiple of 1024 from 1024, at most 100000: full shards commit in the background while "
        "the stream goes on.")
    commit_interval_s: float = Field(
        10.0, gt=0, description="Seconds after which the records written since the last "
        "commit are committed although their shard is not full (the shard stays open and "
        "keeps its rows_per_file): a crash or kill loses at most about this much work, plus "
        "the batch in flight; a signal loses nothing written. Checked after each batch is "
        "written, so it costs one fsync per interval, not per batch.")


class ReportSpec(Strict):
    """What the manifest reports."""

    percentiles: list[float] = Field(
        default_factory=lambda: [50.0, 90.0, 99.0],
        description="Latency percentiles reported per bucket and phase.")
    baseline: Literal["none", "eager"] = Field(
        "none", description="eager: also time eager per bucket and report the speedup.")

    @field_validator("percentiles")
    @classmethod
    def _in_range(cls, v: list[float]) -> list[float]:
        for p in v:
            if not 0 < p <= 100:
                raise ValueError(f"percentiles must lie in (0, 100] (got {p:g})")
        return v


class PipelineSpec(Strict):
    """A graphrun pipeline: model, static buffers, buckets, capture, data, output, report."""

    # inputs and outputs: required without generate:, refused with it (as rules._sections says)
    model_config = ConfigDict(extra="forbid", validate_default=True, json_schema_extra={
        "title": "graphrun pipeline spec, version 1", **IMPLIED_SECTIONS_SCHEMA})

    version: Literal[1] = Field(..., description="Spec format version; 1.")
    name: Text = Field(..., min_length=1, description="Name of the pipeline, used in reports.")
    device: Text = Field("auto", description="auto (cuda if present, else cpu) | cpu | cuda | "
                        "cuda:N.")
    model: ModelSpec
    # Required without generate: (rules._sections); a generation job implies them.
    inputs: dict[str, InputSpec] = Field(
        default_factory=dict, description="Static input buffers by name, in the model's call "
        "order. Required, unless generate: is given (which implies them).")
    outputs: dict[str, OutputSpec] = Field(
        default_factory=dict, description="Names for the model's returns: a tensor, a tuple in "
        "this order, or a dict with these keys. Required, unless generate: is given (which "
        "implies them).")
    buckets: Optional[dict[str, BucketValues]] = Field(
        None, description="Values per bucket axis; one graph per combination. `batch` is "
        "required; values are sorted on load. Required for a forward pass; a generation spec "
        "without it plans both of its axes ({batch: auto, seq: auto}). `auto`: `graphrun run` plans the axis's values "
        "from the input's first records (as `graphrun plan` does), keeping the other axes' "
        "lists, and records the plan in the manifest.")
    buckets_multiple_of: dict[str, Size] = Field(
        default_factory=dict, description="Bucket values of an axis must be multiples of this "
        "(e.g. seq: 8 for kernels that want aligned lengths); planned values obey it too.")
    buckets_max_graphs: Optional[Size] = Field(
        None, description="`auto` axes are planned so that all axes together make at most this "
        "many graphs; a generation spec's graphs are its prefill and decode graphs. `graphrun "
        f"plan` plans to it too, unless --max-graphs is given. null: {MAX_GRAPHS}, or "
        f"{GENERATE_MAX_GRAPHS} for a generation spec.")
    capture: CaptureSpec = Field(default_factory=CaptureSpec)
    data: DataSpec
    generate: Optional[GenerateSpec] = Field(None, description=GENERATE_DOC)
    output: OutputConfig
    report: ReportSpec = Field(default_factory=ReportSpec)

    # The spec file this came from (None when built in Python); targets import beside it.
    _source: Optional[Path] = PrivateAttr(None)

    @property
    def source_path(self) -> Optional[Path]:
        """The spec file this came from, resolved; None when built in Python."""
        return self._source

    @property
    def base_dir(self) -> Path:
        return self._source.parent if self._source else Path.cwd()

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        ok = v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())
        if not ok:
            raise ValueError(f"must be auto, cpu, cuda or cuda:N (got {v!r})")
        return v

    @field_validator("buckets")
    @classmethod
    def _sorted(cls, v: dict[str, list[int] | str] | None) -> dict[str, list[int] | str] | None:
        if v is None:
            return v
        for axis, values in v.items():
            if values == "auto":
                continue
            dup = sorted({x for x in values if values.count(x) > 1})
            if dup:
                raise ValueError(f"{axis}: duplicate bucket values {dup}")
            if not values:
                raise ValueError(f"{axis}: needs at least one value")
        return {axis: values if values == "auto" else sorted(values)
                for axis, values in v.items()}

    @model_validator(mode="after")
    def _implied(self) -> "PipelineSpec":
        """What chat records, an OpenAI Batch file and a generation spec imply, filled in so
        that every later step reads one resolved spec (run.json records it)."""
        d = self.data
        if d.format == "openai_batch" or d.chat is not None:
            if self.generate is None:
                self.generate = GenerateSpec()
            text = d.text or TextSpec()
            given = text.model_fields_set
            if d.format == "openai_batch":
                if d.chat is not None:
                    raise ValueError("data.chat and data.format openai_batch: a Batch request "
                                     "holds its own messages; remove data.chat")
                if d.id_field not in (None, BATCH_ID):
                    raise ValueError(f"data.id_field {d.id_field!r}: an OpenAI Batch file's "
                                     f"ids are its requests' {BATCH_ID}; remove id_field")
                d.id_field, field, special = BATCH_ID, BATCH_BODY, text.add_special_tokens
            else:
                field, special = d.chat.field, False
                if "add_special_tokens" in given and text.add_special_tokens:
                    raise ValueError("data.text.add_special_tokens true with data.chat: the "
                                     "chat template writes the special tokens; remove it")
            if "field" in given and text.field != field:
                raise ValueError(f"data.text.field {text.field!r}: the prompts come from "
                                 f"{field!r} here; remove data.text.field")
            d.text = text.model_copy(update={"field": field, "add_special_tokens": special})
        if self.generate is not None and "format" not in self.output.model_fields_set:
            # npy cannot hold completions: a Batch file's answers in its own format, else JSONL
            self.output.format = "openai_batch" if d.format == "openai_batch" else "jsonl"
        if d.text is not None and d.text.truncate is None:
            d.text.truncate = self.generate is None
        if self.buckets is None:  # a forward pass's are required (spec_checks._sections)
            self.buckets = {} if self.generate is None else {BATCH: "auto", "seq": "auto"}
            if self.generate is None:
                self.__pydantic_fields_set__.discard("buckets")
        return self

    @model_validator(mode="after")
    def _shard_rows(self) -> "PipelineSpec":
        if self.output.rows_per_file is None:
            self.output.rows_per_file = shard_rows(self)
        return self

    # Convenience views used along the flow.
    @property
    def axes(self) -> list[str]:
        """Bucket axes, batch first, then in the order they appear in `buckets`."""
        return [BATCH] + [a for a in self.buckets if a != BATCH]

    def max_size(self, axis: str) -> int:
        return max(self.buckets[axis])

    @property
    def max_graphs(self) -> int:
        """buckets_max_graphs, or the default of the spec's kind (forward pass or generation)."""
        if self.buckets_max_graphs is not None:
            return self.buckets_max_graphs
        return MAX_GRAPHS if self.generate is None else GENERATE_MAX_GRAPHS

    @property
    def auto_axes(self) -> list[str]:
        """Axes whose values `graphrun run` plans from the data (plan.auto.resolve_auto)."""
        return [a for a, v in self.buckets.items() if v == "auto"]


BATCH_ID, BATCH_BODY = "custom_id", "body"  # an OpenAI Batch request's id and its request
SHARD_BYTES = 64 << 20  # an output shard's size, where output.rows_per_file is null
SHARD_ROWS = (1024, 100000)
UNKNOWN_AXIS = 512  # an axis of outputs whose buckets are planned at run time (auto)


def shard_rows(spec: "PipelineSpec") -> int:
    """output.rows_per_file's default: records making about SHARD_BYTES of outputs, estimated
    from the spec alone (so a resumed run and --gpus workers compute the same)."""
    itemsize = {"float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
                "bool": 1, "float16": 2, "bfloat16": 4}  # bfloat16 is written as float32
    row = 0
    for o in spec.outputs.values():
        cells = 1
        for d in o.shape[1:]:
            values = spec.buckets.get(d) if isinstance(d, str) else None
            cells *= (d if isinstance(d, int) else max(values)
                      if isinstance(values, list) else UNKNOWN_AXIS)
        row += cells * itemsize.get(o.dtype or "", 4)
    if spec.generate is not None:  # token ids and their text, at most max_new_tokens each
        row += spec.generate.max_new_tokens * 16
    rows = SHARD_BYTES // max(row, 1)
    return max(SHARD_ROWS[0], min(SHARD_ROWS[1], rows // 1024 * 1024))

