"""The job file: one YAML document, validated into a `Job` before any work starts.

Relative paths in a job file are relative to the job file's own directory, so a job and the
data beside it can be moved together. schemas/job.schema.json is generated from these models
(`dflash-batch schema`); unknown keys are errors so typos cannot pass silently.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_batch.limits import MAX_LOGIT_BIAS, MAX_LOGPROBS, MIN_HEAD_TOKENS

MAX_CONTEXT = 131072
# Nominal memory of the GPUs engine.gpu_memory names, in GB (10^9 bytes; the driver reports a
# little more: an H200's total_memory is 150.1e9 bytes).
GPUS = {"h100": 80, "h200": 141, "b200": 180, "gb300": 288}
GRAMMAR_FIELDS = ("json_schema", "regex", "choice")  # structured output: at most one per sample
OPENAI_PASSTHROUGH = ["url", "model"]  # what export --format openai_batch needs of each request


def gpu_bytes(text: str) -> int:
    """'h200' or a size in GB -> bytes."""
    key = str(text).strip().lower()
    if key in GPUS:
        return GPUS[key] * 10**9
    try:
        size = float(key.removesuffix("gb"))
    except ValueError:
        size = 0.0
    if not 1 <= size < float("inf"):  # below 1 GB: a slip (MB? a fraction?), not a GPU
        raise ValueError(f"GPU memory {text!r}: give a size in GB (1 or more) or one of {', '.join(GPUS)}")
    return int(size * 10**9)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    """Where the prompts come from and which columns hold what."""

    paths: list[str] = Field(min_length=1, description="Files, globs or directories (Parquet or JSONL).")
    format: Literal["auto", "jsonl", "parquet", "openai_batch"] = Field(
        "auto", description="auto: from the file extension. openai_batch: JSONL request lines of the OpenAI "
        "Batch API ({custom_id, method, url, body}, chat completions or completions): custom_id is the row "
        "id, the body gives the prompt and the sampling (over the job's); url and model are passed through.")
    id_column: str | None = Field(None, description="Column holding a unique row id; absent: a stable "
                                  "hash of (file, row index).")
    prompt_column: str | None = Field(None, description="Raw prompt text (no chat template).")
    messages_column: str | None = Field(None, description="Chat messages [{role, content}], rendered "
                                        "with the tokenizer's chat template.")
    input_ids_column: str | None = Field(None, description="Pre-tokenised prompt (list of ints).")
    system_prompt: str | None = Field(None, description="Prepended as a system message to messages "
                                      "that have none.")
    tools_column: str | None = Field(None, description="Tool definitions (a list of objects) passed to the "
                                     "chat template as `tools`, as transformers' apply_chat_template does.")
    followups_column: str | None = Field(None, description="Later user turns of each row's conversation (a "
                                         "list of strings or {role, content} messages): each follows the "
                                         "assistant's turn before it, through the chat template (docs: "
                                         "Conversations).")
    passthrough_columns: list[str] = Field(default_factory=list, description="Input columns copied to "
                                           "the output rows unchanged.")
    sampling_columns: dict[str, str] = Field(default_factory=dict, description="Per-row sampling "
                                             "overrides: sampling field -> input column (a row's "
                                             "chat_template_kwargs are merged over the job's).")
    batch_rows: int = Field(4096, ge=1, description="Rows read and tokenised per batch.")
    window_rows: int = Field(16384, ge=1, description="Rows grouped into length buckets at a time "
                             "(bounds memory on huge inputs).")
    workers: int = Field(2, ge=0, le=64, description="Processes that read, template and tokenise rows "
                         "ahead of the engine; 0: a thread of the main process.")
    allow_empty: bool = Field(False, description="Accept an input file with no rows; by default one is "
                              "refused before any work (a wrong file or an unfinished export, not a run of "
                              "nothing).")

    @model_validator(mode="before")
    @classmethod
    def _openai_passthrough(cls, data: Any) -> Any:
        """An OpenAI request's url and model travel with its rows (export writes them back)."""
        if isinstance(data, dict) and data.get("format") == "openai_batch":
            given = data.get("passthrough_columns") or []
            if isinstance(given, list):
                data = {**data, "passthrough_columns": [*OPENAI_PASSTHROUGH, *(c for c in given
                                                                               if c not in OPENAI_PASSTHROUGH)]}
        return data

    @model_validator(mode="after")
    def _one_prompt_column(self) -> InputSpec:
        if self.format == "openai_batch":
            fixed = [f for f in ("prompt_column", "messages_column", "input_ids_column", "id_column", "tools_column",
                                 "followups_column")
                     if getattr(self, f)] + ["sampling_columns"] * bool(self.sampling_columns)
            if fixed:
                raise ValueError(f"format openai_batch: each request line gives its own id, prompt, tools and "
                                 f"sampling; remove {fixed}")
            return self
        given = [c for c in (self.prompt_column, self.messages_column, self.input_ids_column) if c]
        if len(given) != 1:
            raise ValueError("set exactly one of prompt_column, messages_column, input_ids_column "
                             f"(got {len(given)})")
        if self.tools_column and not self.messages_column:
            raise ValueError("tools_column is only used with messages_column (the chat template renders it)")
        if self.followups_column and not self.messages_column:
            raise ValueError("followups_column needs messages_column (the chat template renders each turn)")
        return self

    def rows_may_set(self, field: str) -> bool:
        """Whether a row may set this sampling field (through sampling_columns, or a request body)."""
        return field in self.sampling_columns or self.format == "openai_batch"

    @field_validator("sampling_columns")
    @classmethod
    def _known_sampling_fields(cls, v: dict[str, str]) -> dict[str, str]:
        fields = list(SamplingSpec.model_fields)  # every sampling field can come from a column
        bad = sorted(set(v) - set(fields))
        if bad:
            raise ValueError(f"unknown sampling field(s) {bad}; allowed: {fields}")
        return v


class ModelSpec(_Strict):
    target: str = Field(description="Target checkpoint directory (HF layout: config.json + safetensors).")
    drafter: str | None = Field(None, description="DFlash drafter checkpoint directory; absent: "
                                "target-only decoding.")
    tokenizer: str | None = Field(None, description="Tokenizer directory; default: the target's.")
    chat_template: str | None = Field(None, description="Path of a Jinja chat template overriding the "
                                      "tokenizer's.")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = Field(
        "bfloat16", description="float64: exact runs for checks (resume == uninterrupted to the bit), CPU speed.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Ranks a stage splits every layer across "
                                      "(one node's GPUs, or fewer).")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="Stages the target's layers are split "
                                        "into, contiguous and balanced by their bytes, one node a stage: a round's "
                                        "rows go through the stages in turn (the drafter and the decision on the "
                                        "last). The run has tensor_parallel_size x pipeline_parallel_size ranks.")
    data_parallel_size: int = Field(1, ge=1, le=64, description="Attention groups, each tensor_parallel_size "
                                    "consecutive ranks (one node's GPUs) with its own rows, caches and drafter: "
                                    "the run has data_parallel_size x tensor_parallel_size ranks, and group g of "
                                    "shard i/n runs shard i x data_parallel_size + g of n x data_parallel_size. "
                                    "Without expert_parallel the groups share nothing.")
    expert_parallel: bool = Field(False, description="Shard the target's routed experts whole over every rank of "
                                  "every data-parallel group (vLLM's --enable-expert-parallel), each rank reading "
                                  "only its experts from the checkpoint; shared experts, dense layers, embeddings "
                                  "and the head stay tensor-parallel inside the group. Each MoE layer sends the "
                                  "group's latent rows to every group and takes back their sums, so the groups run "
                                  "their target forwards in lockstep (a group with no rows left serves the others'). "
                                  "Needs a target with routed experts (Kimi-K3) dividing evenly over the ranks.")
    redundant_experts: int = Field(0, ge=0, le=64, description="Replica slots a rank adds under expert_parallel, "
                                   "for the experts with the most routed tokens (EPLB): from expert_placement's "
                                   "counts, else spread over the experts in id order.")
    expert_placement: str | None = Field(None, description="A placement file from `dflash-batch experts place "
                                         "RUN_DIR` (a previous run's routing counts, e.g. a Slurm array's pilot "
                                         "shard): which experts each rank holds, layer by layer. Needs "
                                         "expert_parallel; its ranks and redundant_experts must be the job's.")

    @property
    def ranks(self) -> int:
        """The run's ranks: every stage's tensor-parallel group, in every data-parallel group."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @model_validator(mode="after")
    def _experts_across_ranks(self) -> ModelSpec:
        if self.data_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError("model.data_parallel_size and model.pipeline_parallel_size do not combine yet: "
                             "set one of them to 1")
        if not self.expert_parallel and (self.redundant_experts or self.expert_placement):
            field = "redundant_experts" if self.redundant_experts else "expert_placement"
            raise ValueError(f"model.{field} places routed experts on ranks: it needs model.expert_parallel: true")
        if self.expert_parallel and self.pipeline_parallel_size > 1:
            raise ValueError("model.expert_parallel does not run under pipeline stages yet "
                             "(model.pipeline_parallel_size 1)")
        return self


class AutoSpeculationSpec(_Strict):
    min_acc_len: float = Field(1.5, ge=1.0, description="An auto bucket stops speculating when its acceptance "
                               "length over the last `rounds` sequence-rounds is below this.")
    rounds: int = Field(1024, ge=1, description="Sequence-rounds (one per running sequence per round) the "
                        "acceptance length is measured over.")


class EngineSpec(_Strict):
    max_model_len: int = Field(8192, ge=16, le=MAX_CONTEXT, description="Prompt + generated tokens, "
                               "at most.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences decoded together (default for buckets).")
    max_num_batched_tokens: int = Field(8192, ge=16, description="Tokens per forward (chunked prefill "
                                        "budget).")
    share_prompts: bool = Field(True, description="Rows whose prompts begin alike (64 tokens or more) prefill "
                                "that head once, and samples of one prompt admitted together prefill it once "
                                "(docs: Job file, engine.share_prompts).")
    turn_caches: bool = Field(True, description="A conversation's later turns go on from its row's caches and "
                              "prefill only their own tokens; false: each turn prefills its whole history, as a "
                              "single-turn engine must (to compare).")
    shared_head_tokens: int = Field(8192, ge=0, description="The longest prompt head rows share (a longer "
                                    "one is shared this far); the memory plan counts two heads of it per "
                                    "bucket, once. 0: no shared heads (samples of a prompt still fork); "
                                    "else at least 64 (a shorter head is never shared).")
    backend: Literal["auto", "torch", "flashinfer"] = Field(
        "auto", description="Attention backend. auto: flashinfer on a CUDA host that has it, for GQA "
        "models; else torch (torch: the CPU reference path, even on a CUDA host).")
    context_parallel: bool | None = Field(
        None, description="Split every sequence's MLA latent caches (Kimi-K3's and the DFlash2-MLA drafter's) "
        "across the tensor-parallel ranks by token: each rank keeps 1/tensor_parallel_size of them, so a GPU "
        "holds more sequences (dflash-batch plan shows how many), for two collectives per MLA layer. Needs an "
        "MLA target and drafter, and tensor_parallel_size > 1 dividing page_size; true elsewhere is refused. "
        "Absent: on where it pays, which the memory plan decides: with engine.gpu_memory set, when the buckets "
        "as written do not fit a GPU without it (run and validate say so); off otherwise.")
    micro_batches: int = Field(
        1, ge=1, le=64, description="Lanes the running sequences split into under pipeline stages "
        "(model.pipeline_parallel_size > 1), each decoding rounds of its own: while the last stage decides and "
        "drafts lane m's round, the first verifies lane m + 1's, so with at least as many lanes as stages no "
        "stage waits for a whole round (a round captured as a graph instead goes through in that many groups, "
        "the pipe filling and draining). Each lane reads a stage's weights again: dflash-batch plan's roofline "
        "compares. Over 1 needs stages; on flashinfer (which lays a round out whole) rounds always run in lanes, "
        "without CUDA graphs.")
    cuda_graphs: bool | None = Field(
        None, description="Capture the decode round as CUDA graphs. Absent: on where they can run (a "
        "CUDA device, a Qwen3 target, one rank); true where they cannot is refused.")
    compile: bool | None = Field(
        None, description="torch.compile the decode round (the CPU path). Absent: on for CPU runs of a "
        "Qwen3 target on one rank, for buckets whose requests need enough rounds to pay for it (the log "
        "says when a bucket runs uncompiled, and why); true: always; true where it cannot run is refused.")
    cache_dir: str | None = Field(
        None, description="Where compiled code is kept for the next process (torch.compile's inductor cache "
        "on the CPU, Triton's kernels on a GPU): a resume, a rerun and an array's other tasks load it "
        "instead of compiling again (a shared filesystem for Slurm arrays). Absent: $DFLASH_CACHE_DIR, "
        "else OUTPUT_DIR/.compile_cache. TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR set in the "
        "environment win.")
    cudagraph_capture_sizes: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="Batch sizes captured as CUDA graphs (a round is padded to the next one); "
        "absent: powers of two up to the largest max_num_seqs, and it. Only with CUDA graphs on.")
    page_size: int = Field(16, ge=1, description="Tokens per KV-cache page.")
    auto_speculation: AutoSpeculationSpec | None = Field(
        None, description="When buckets with `speculation: auto` turn it off; absent: the defaults. Only "
        "with such a bucket.")
    gpu_memory: str | None = Field(
        None, description="The GPU each rank runs on (h100, h200, b200, gb300, or its memory in GB): "
        "validate and run refuse the job when its memory plan (dflash-batch plan) does not fit it.")
    gpu_memory_headroom: float = Field(
        0.0, ge=0.0, lt=1.0, description="A share of the GPU (0.03: 3%) the buckets leave free beyond the "
        "reserve, for what a plan from config.json cannot see (workspaces past their defaults, NCCL, allocator "
        "growth): validate, run and dflash-batch plan fit the buckets in what is left. Only with gpu_memory.")

    @field_validator("gpu_memory")
    @classmethod
    def _known_gpu(cls, value: str | None) -> str | None:
        if value is not None:
            gpu_bytes(value)
        return value

    @model_validator(mode="after")
    def _shared_heads(self) -> EngineSpec:
        if 0 < self.shared_head_tokens < MIN_HEAD_TOKENS:
            raise ValueError(f"shared_head_tokens {self.shared_head_tokens}: a head shorter than {MIN_HEAD_TOKENS} "
                             "tokens is never shared; give 0 (no shared heads) or at least that")
        if not self.share_prompts and "shared_head_tokens" in self.model_fields_set:
            raise ValueError("shared_head_tokens is set but share_prompts is false: nothing is shared (drop one)")
        return self

    @model_validator(mode="after")
    def _headroom_needs_a_gpu(self) -> EngineSpec:
        if self.gpu_memory is None and self.gpu_memory_headroom:
            raise ValueError("gpu_memory_headroom is set but gpu_memory is not: no GPU to keep it free on "
                             "(set gpu_memory, or drop it)")
        return self


class PinnedDrafts(_Strict):
    drafts: int = Field(ge=0, le=63, description="Drafts every round verifies (0: none, the drafter's "
                        "context kept; the block's drafts at most): the drafter still proposes its whole block.")


class AutoDrafts(_Strict):
    per_row: bool = Field(description="speculation: auto, each row of a round verifying the drafts worth "
                          "verifying by the drafter's confidence in them and the round's cost (true, auto's "
                          "default), or every row the same number a round (false).")


class BucketSpec(_Strict):
    max_tokens: int = Field(ge=1, le=MAX_CONTEXT, description="Upper edge: prompt + max_new_tokens.")
    max_num_seqs: int | None = Field(None, ge=1, description="Default: engine.max_num_seqs.")
    speculation: bool | Literal["auto"] | PinnedDrafts | AutoDrafts = Field(
        True, description="Use the drafter in this bucket (if one is configured), verifying its whole block. "
        "auto: verify, at each batch size, the number of drafts that yields the most tokens per second by "
        "the round costs timed on this device and the acceptance seen so far, each row the drafts worth "
        "verifying by the drafter's confidence in them (one stage, and not on flashinfer under CUDA graphs; "
        "elsewhere one number a round); turn the drafter off when that is none at any batch size or the acceptance length "
        "falls below engine.auto_speculation.min_acc_len (needs model.drafter). {per_row: false}: auto with "
        "one number of drafts for every row of a round. {drafts: K}: verify K drafts a round, every row.")
    block_size: int | None = Field(None, ge=2, le=64, description="Verify width (anchor + drafts); "
                                   "default: the drafter's.")


class SamplingSpec(_Strict):
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0 = off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Keep tokens at least min_p times as likely "
                         "as the most likely one (after top-k and top-p); 0 = off.")
    max_new_tokens: int = Field(256, ge=1)
    min_tokens: int = Field(0, ge=0, description="Stop token ids (EOS included) are held back until this "
                            "many tokens are generated (stop strings are not).")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="Added to the target's logits "
                                         f"of these token ids before any filtering (at most {MAX_LOGIT_BIAS} "
                                         "ids, each bias in [-100, 100]).")
    repetition_penalty: float = Field(1.0, gt=0.0, description="A token in the prompt or already generated "
                                      "has its logit divided by this where positive, multiplied where not "
                                      "(after logit_bias); 1 = off.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from a token's logit once "
                                     "per time it was generated (not counting the prompt); 0 = off.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted from the logit of every "
                                    "token generated at least once (not counting the prompt); 0 = off.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Write each generated token's "
                                 "logprob and the top-K (id, logprob) at its position: log_softmax(target "
                                 "logits / temperature), temperature 0 read as 1, before logit_bias, "
                                 "penalties and filters. 0 = the token's own only; absent = none.")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="The same for every prompt "
                                        "token after the first (needs the prompt's logits: prefill then costs "
                                        "a vocabulary-wide row per prompt token).")
    json_schema: dict[str, Any] | str | None = Field(None, description="Structured output: every sample "
                                                     "is JSON valid under this schema (compact, no free "
                                                     "whitespace), through xgrammar.")
    regex: str | None = Field(None, description="Structured output: every sample matches this regex.")
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="Structured output: every sample is one of these strings.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (matched on decoded text; "
                            "the output is cut before the match).")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=1024, description="Samples per prompt (one output row each).")
    seed: int = Field(0, description="Job seed; each sample's seed derives from (seed, row_id, "
                      "sample_index).")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed to the chat "
                                                 "template, e.g. {thinking: false}.")

    @field_validator("logit_bias")
    @classmethod
    def _bounded_bias(cls, v: dict[int, float]) -> dict[int, float]:
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} token ids, got {len(v)}")
        bad = [t for t, b in v.items() if t < 0 or not -100 <= b <= 100]
        if bad:
            raise ValueError(f"token ids must be >= 0 and biases in [-100, 100]: {bad[:5]}")
        return v

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingSpec:
        given = [f for f in GRAMMAR_FIELDS if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"at most one of json_schema, regex and choice; got {given}")
        if given and self.ignore_eos and not self.stop_token_ids:
            raise ValueError(f"{given[0]} needs a stop token to end on: ignore_eos leaves none "
                             "(give stop_token_ids)")
        return self

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v


class OutputSpec(_Strict):
    dir: str = Field(description="Output directory (one per logical run).")
    rows_per_part: int = Field(1000, ge=1, description="Rows per Parquet part file.")
    flush_seconds: float = Field(300.0, gt=0, description="Commit a part at least this often.")
    max_error_fraction: float = Field(0.5, ge=0, le=1, description="A run whose error rows are more than this "
                                      "fraction of the rows it ran (or all of them) exits 3 after committing them.")
    compression: Literal["zstd", "snappy", "gzip", "none"] = "zstd"
    include_token_ids: bool = Field(False, description="Add response_token_ids to each row.")
    include_prompt: bool = Field(False, description="Add the rendered prompt text to each row.")
    split_reasoning: bool = Field(False, description="Write a thinking model's reasoning to a `reasoning` "
                                  "column and only the answer to `response`, split at its think delimiters.")
    reasoning_delimiters: list[str] | None = Field(
        None, min_length=2, max_length=2, description="[START, END] think tokens for split_reasoning; "
        "default: the first known pair (<think>/</think>, ◁think▷/◁/think▷) the tokenizer has.")

    @model_validator(mode="after")
    def _delimiters_need_the_split(self) -> OutputSpec:
        if self.reasoning_delimiters and not self.split_reasoning:
            raise ValueError("reasoning_delimiters is only used with split_reasoning: true")
        return self


class ShardingSpec(_Strict):
    mode: Literal["auto", "slurm", "kubernetes", "explicit", "none"] = Field(
        "auto", description="auto: Slurm array variables if set, else a Kubernetes indexed Job's "
        "JOB_COMPLETION_INDEX if set, else a single shard.")
    index: int | None = Field(None, ge=0)
    count: int | None = Field(None, ge=1, description="explicit: the shard count; kubernetes (and auto under "
                              "a Kubernetes indexed Job): the shard count, else DFLASH_SHARDS.")

    @model_validator(mode="after")
    def _explicit_needs_both(self) -> ShardingSpec:
        if self.mode == "explicit":
            if self.index is None or self.count is None:
                raise ValueError("mode: explicit needs both index and count")
            if self.index >= self.count:
                raise ValueError(f"index {self.index} must be < count {self.count}")
        elif self.index is not None:
            raise ValueError("index is only used with mode: explicit (Slurm and Kubernetes give it)")
        elif self.count is not None and self.mode not in ("kubernetes", "auto"):
            raise ValueError("count is only used with mode: explicit, kubernetes or auto")
        return self


class RetrySpec(_Strict):
    """Written by `dflash-batch retry`: this run redoes chosen samples of a finished run."""

    parent: str = Field(description="The parent run's output directory.")
    parent_hash: str = Field(description="The parent's config_hash (its run.json) when the retry was made.")
    samples: str = Field(description="Parquet file of the (row_id, sample_index) keys this run generates.")
    where: list[str] = Field(description="What chose them (dflash-batch retry --where).")
    changes: dict[str, Any] = Field(default_factory=dict, description="Job fields set unlike the parent's "
                                    "(dotted name -> value); a sampling field here replaces rows' own values.")


_DOTTED = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"


class ToolsSpec(_Strict):
    """The functions a conversation's assistant turns may call."""

    module: str = Field(pattern=_DOTTED, description="An importable Python module: its public functions are the "
                        "tools (only those, by name, with JSON arguments; nothing the model writes is evaluated). "
                        "Its TOOLS list, if any, gives their definitions for the chat template; else they are read "
                        "from the functions' signatures and docstrings.")
    timeout_s: float = Field(30.0, gt=0, description="A call still running after this long gives the model an "
                             "error message instead of its result.")
    format: Literal["auto", "hermes", "kimi"] = Field(
        "auto", description="How assistant turns write tool calls: hermes (<tool_call>{json}</tool_call>: Qwen3), "
        "kimi (<|tool_call_begin|>...: Kimi-K2/K3); auto: the one the chat template writes.")


class FollowupsSpec(_Strict):
    function: str = Field(pattern=_DOTTED[:-1] + r":[A-Za-z_][A-Za-z0-9_]*$",
                          description="module:function, called with the conversation's messages after each "
                          "assistant turn; returns the next user message (a string or a message dict) or None "
                          "to end the conversation (a user simulator).")


class ConversationSpec(_Strict):
    """Rows that are conversations: later user turns (input.followups_column, or a simulator)
    and tool calls, each continuing from the row's caches (docs: Conversations)."""

    max_turns: int = Field(8, ge=1, le=1024, description="Assistant turns a conversation has at most (turns that "
                           "call tools count).")
    tools: ToolsSpec | None = None
    followups: FollowupsSpec | None = Field(None, description="A user simulator (instead of, or after, the "
                                            "followups column's turns).")
    tool_workers: int = Field(8, ge=1, le=256, description="Conversations whose next turn is made at once off the "
                              "engine's thread (their tool calls, each in a thread of its own, or the simulator).")


class Job(_Strict):
    version: Literal[1] = 1
    name: str | None = None
    input: InputSpec
    model: ModelSpec
    engine: EngineSpec = EngineSpec()
    buckets: list[BucketSpec] = Field(default_factory=list, description="Length buckets, ascending "
                                      "edges; default: one bucket up to engine.max_model_len.")
    sampling: SamplingSpec = SamplingSpec()
    overflow: Literal["error", "truncate_left", "truncate_right"] = Field(
        "error", description="A prompt that does not fit the largest bucket edge - max_new_tokens.")
    output: OutputSpec
    sharding: ShardingSpec = ShardingSpec()
    conversation: ConversationSpec | None = Field(None, description="Rows as conversations with tools or a user "
                                                  "simulator (input.followups_column alone needs none).")
    retry: RetrySpec | None = Field(None, description="Set by `dflash-batch retry`: the run it redoes rows of.")

    @model_validator(mode="before")
    @classmethod
    def _openai_defaults(cls, data: Any) -> Any:
        """OpenAI request lines mean OpenAI's defaults where neither the body nor the job says:
        temperature 1 (ours is 0). Written into the job, so run.json and retries keep it."""
        if isinstance(data, dict) and isinstance(data.get("input"), dict) and \
                data["input"].get("format") == "openai_batch":
            sampling = data.get("sampling") or {}
            if isinstance(sampling, dict) and "temperature" not in sampling:
                data = {**data, "sampling": {**sampling, "temperature": 1.0}}
        return data

    @model_validator(mode="after")
    def _buckets_ascending(self) -> Job:
        edges = [b.max_tokens for b in self.buckets]
        if edges != sorted(set(edges)):
            raise ValueError(f"buckets must have strictly ascending max_tokens, got {edges}")
        if edges and edges[-1] > self.engine.max_model_len:
            raise ValueError(f"the last bucket ({edges[-1]}) exceeds engine.max_model_len "
                             f"({self.engine.max_model_len})")
        auto = [b.max_tokens for b in self.buckets if b.speculation == "auto" or isinstance(b.speculation, AutoDrafts)]
        if auto and not self.model.drafter:
            raise ValueError(f"buckets {auto} have speculation: auto, which needs model.drafter")
        for b in self.buckets:
            if isinstance(b.speculation, PinnedDrafts):
                if not self.model.drafter:
                    raise ValueError(f"bucket {b.max_tokens} has speculation: {{drafts: {b.speculation.drafts}}}, "
                                     "which needs model.drafter")
                if b.block_size is not None and b.speculation.drafts >= b.block_size:
                    raise ValueError(f"bucket {b.max_tokens}: speculation drafts {b.speculation.drafts} must be "
                                     f"below its block_size {b.block_size} (a block holds block_size - 1 drafts)")
        if self.engine.auto_speculation is not None and not auto:
            raise ValueError("engine.auto_speculation is set but no bucket has speculation: auto; remove it")
        return self

    @model_validator(mode="after")
    def _conversations_read_messages(self) -> Job:
        if self.conversation is not None and not self.input.messages_column:
            raise ValueError("conversation needs input.messages_column (the chat template renders each turn)")
        if not self.conversations:
            return self
        for field in ("logprobs", "prompt_logprobs", *GRAMMAR_FIELDS):
            if getattr(self.sampling, field) is not None or field in self.input.sampling_columns:
                raise ValueError(f"sampling.{field} is not supported in conversations yet (a turn's {field} would "
                                 "have to be kept per turn); remove it or the conversation settings")
        if self.model.pipeline_parallel_size > 1:
            raise ValueError("conversations do not run under pipeline stages yet (model.pipeline_parallel_size 1)")
        hosted = self.conversation is not None and (self.conversation.tools or self.conversation.followups)
        if hosted and self.model.data_parallel_size > 1:
            raise ValueError("conversation.tools and conversation.followups do not run in data-parallel groups yet "
                             "(model.data_parallel_size 1); input.followups_column works there")
        if hosted and self.model.tensor_parallel_size > 1:
            raise ValueError("conversation.tools and conversation.followups run on one host: under "
                             "tensor_parallel_size > 1 every rank would need rank 0's results (not yet); "
                             "input.followups_column works there")
        return self

    @property
    def conversations(self) -> bool:
        """Its rows are conversations (every row, though some end after one turn)."""
        return self.conversation is not None or self.input.followups_column is not None

    def resolved_buckets(self) -> list[BucketSpec]:
        return self.buckets or [BucketSpec(max_tokens=self.engine.max_model_len)]

    def output_hash(self, identity: dict | None = None) -> str:
        """Hash of everything that decides the outputs: TUNING fields, the sharding and the name
        are left out, so they may change between resumes. With `identity`, the content of the
        files LOCATIONS name (io/fingerprint.py) stands for their paths; without, the hash holds
        the paths, as it did for runs made before."""
        exclude: dict[str, Any] = {**TUNING, "sharding": True, "name": True}
        if identity is not None:
            exclude |= {section: TUNING.get(section, set()) | fields for section, fields in LOCATIONS.items()}
        doc = self.model_dump(mode="json", exclude=exclude)
        for b in doc["buckets"]:
            b.pop("max_num_seqs", None)
        if doc["retry"] is None:  # a plain run hashes as it did before retries existed
            del doc["retry"]
        if identity is not None:
            doc["identity"] = identity
        return hashlib.sha256(orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


# Settings that decide how fast outputs are made, never what they are (allow_empty only lets an
# empty file through: it adds no row).
TUNING: dict[str, set[str]] = {
    "engine": {"max_num_seqs", "max_num_batched_tokens", "share_prompts", "shared_head_tokens", "backend",
               "turn_caches",
               "context_parallel", "gpu_memory_headroom",
               "cuda_graphs", "compile",
               "cudagraph_capture_sizes", "cache_dir"},
    "input": {"workers", "allow_empty"},
    "conversation": {"tool_workers"},
    "output": {"dir", "rows_per_part", "flush_seconds", "max_error_fraction"},  # the last: the exit code only
}


# Fields naming files: a run is hashed by what they hold, not where they lie (output_hash), so a
# run moved with its files, or read through another mount, stays the same run.
LOCATIONS: dict[str, set[str]] = {"input": {"paths"}, "model": {"target", "drafter", "tokenizer", "chat_template"}}


def is_location(field: str) -> bool:
    """Whether a dotted job field names files (LOCATIONS)."""
    section, _, rest = field.partition(".")
    return rest in LOCATIONS.get(section, ())


def is_tuning(field: str) -> bool:
    """Whether a dotted job field (`engine.backend`, `buckets.1.max_num_seqs`) is left out of
    Job.output_hash."""
    section, _, rest = field.partition(".")
    return (section in ("sharding", "name") or rest in TUNING.get(section, ())
            or (section == "buckets" and rest.endswith(".max_num_seqs")))


class JobError(ValueError):
    """A job file that cannot run; the message says where and what to fix."""


def _resolve(base: Path, p: str | None) -> str | None:
    if p is None or "://" in p:
        return p
    path = Path(p).expanduser()
    return str(path if path.is_absolute() else (base / path))


def _format_errors(source: str, err: ValidationError) -> str:
    lines = [f"{source}: invalid job file ({err.error_count()} problem(s)):"]
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; see schemas/job.schema.json)"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e['input']!r})"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def parse_job(doc: Any, source: str = "<job>", base_dir: Path | None = None) -> Job:
    """Validate a parsed YAML document; paths are resolved against base_dir."""
    if not isinstance(doc, dict):
        raise JobError(f"{source}: a job file must be a YAML mapping, got {type(doc).__name__}")
    try:
        job = Job.model_validate(doc)
    except ValidationError as err:
        raise JobError(_format_errors(source, err)) from None
    if base_dir is None:
        return job
    inp = job.input.model_copy(update={"paths": [_resolve(base_dir, p) for p in job.input.paths]})
    model = job.model.model_copy(update={k: _resolve(base_dir, getattr(job.model, k))
                                         for k in ("target", "drafter", "tokenizer", "chat_template")})
    out = job.output.model_copy(update={"dir": _resolve(base_dir, job.output.dir)})
    engine = job.engine.model_copy(update={"cache_dir": _resolve(base_dir, job.engine.cache_dir)})
    retry = job.retry and job.retry.model_copy(update={k: _resolve(base_dir, getattr(job.retry, k))
                                                       for k in ("parent", "samples")})
    return job.model_copy(update={"input": inp, "model": model, "output": out, "retry": retry, "engine": engine})


def read_job_file(path: Path) -> Any:
    """A job file's YAML document, not validated yet."""
    try:
        text = path.read_text()
    except OSError as e:
        raise JobError(f"{path}: cannot read job file ({e.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise JobError(f"{path}: not valid YAML: {e}") from None


def load_job(path: str | Path) -> Job:
    path = Path(path)
    return parse_job(read_job_file(path), str(path), path.resolve().parent)


def check_model_paths(model: ModelSpec) -> None:
    """Every checkpoint, tokenizer and template path of the job exists (a checkpoint with its
    config.json), checked before anything reads them: a mistyped path is named by its field,
    not by the first file a later step misses in it."""
    for field in ("target", "drafter", "tokenizer", "chat_template"):
        path = getattr(model, field)
        if path is None:
            continue
        where = Path(path)
        if not where.exists():
            raise JobError(f"model.{field}: {path} does not exist")
        if field == "chat_template":
            if not where.is_file():
                raise JobError(f"model.chat_template: {path} is not a file")
        elif not where.is_dir():
            raise JobError(f"model.{field}: {path} is not a directory")
        elif field != "tokenizer" and not (where / "config.json").is_file():
            raise JobError(f"model.{field}: {path} is not a checkpoint: no config.json")


def job_json_schema() -> dict:
    return Job.model_json_schema()
