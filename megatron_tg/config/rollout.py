"""Generation of agent rollouts, and the judge that scores them and writes feedback."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_tg.config.base import ConfigError, check_choice, check_range

ENGINES = ("embedded", "sglang")
SANDBOXES = ("bwrap", "none", "apptainer", "enroot", "pyxis")
TOOL_CALL_READINGS = ("strict", "sglang")  # megatron_tg.chat.tool_reading.READINGS
STALE_POLICIES = ("drop", "regenerate")
PAUSE_MODES = ("in_place", "retract", "abort")
SYNC_BACKENDS = ("auto", "nccl", "gloo")
SERVICE_MODES = ("in_process", "local", "remote")  # megatron_tg/sampling/service (docs/rollout-service.md)
PLACEMENTS = ("disaggregated", "colocated")  # docs/colocated.md


@dataclass
class RolloutConfig:
    """Who generates rollouts, how many, how long they may run, and how stale they may be."""

    engine: str = "embedded"
    """"embedded" = generate with the trainer's own model in-process (CPU tests, tiny models);
    "sglang" = separate SGLang servers that receive weights after every step (GPU clusters)."""

    placement: str = "disaggregated"
    """Where the engines run relative to the trainer: "disaggregated" = on GPUs of their own,
    generating while the trainer trains; "colocated" = on the trainer's GPUs, taking turns
    (docs/colocated.md): each step the engines release their memory (all tags), the trainer
    loads its state back, trains, puts its state aside, the engines resume their weights and
    receive the new ones through ``/update_weights_from_tensor`` (bucketed, SGLang's
    ``flattened_bucket`` format), then resume their KV cache and generate. Needs
    ``max_staleness=0`` and engines started with ``--enable-memory-saver``
    (the embedded engines this process or its rollout service starts get it). With a rollout
    service (``service`` local or remote) the service generates and judges; trainer rank 0
    still releases, resumes and writes the engines itself."""

    server_urls: List[str] = field(default_factory=list)
    """Base URLs of already running SGLang servers. Empty = start ``num_engines`` of them."""

    num_engines: int = 1
    """SGLang servers to start when ``server_urls`` is empty (ignored by "embedded")."""

    engine_tp: int = 1
    """GPUs per SGLang server (its tensor-parallel size); rollout GPUs = num_engines * engine_tp."""

    group_size: int = 8
    """G: rollouts sampled per prompt. GRPO's advantage is relative to the group's mean."""

    prompts_per_step: int = 8
    """Prompts (groups) per optimizer step; a step trains on prompts_per_step * group_size rollouts."""

    temperature: float = 1.0
    """Sampling temperature. 1.0 keeps the sampler equal to the policy the loss assumes."""

    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off; below 1 the samples are no longer from the policy)."""

    max_new_tokens: int = 1024
    """Most tokens generated in one assistant turn."""

    max_turns: int = 8
    """Most assistant turns per rollout; the rollout is cut (and scored as is) after that."""

    max_context_tokens: int = 4096
    """Most tokens in a whole rollout (prompt, turns, tool output); must fit model.seq_length."""

    max_staleness: int = 1
    """Most policy versions a rollout's sampler may lag the trainer (0 = fully on-policy, no
    overlap of generation and training). Older rollouts are dropped, not trained on."""

    routing_replay: bool = True
    """MoE only: engines return each token's routed experts (``return_routed_experts``; an
    SGLang server also needs ``--enable-return-routed-experts``), rollouts store them, and the
    student pass replays them through megatron's router replay, so the trainer scores the
    experts that sampled. Without it, routing flips between engine and trainer change the
    scored function (published GRPO runs on Qwen3-30B-A3B without replay collapsed)."""

    buffer_size: int = 16
    """Most finished groups queued for the trainer; generation pauses while it is full."""

    max_inflight_rollouts: int = 0
    """Most rollouts generating at once (the engines' load); a new group starts when there is
    room for all group_size of its rollouts. 0 = buffer_size * group_size."""

    env_workers_per_node: int = 0
    """Most tool calls (sandboxed commands, gradings) running at once in one rollout-side
    process; a rollout whose tool call finds every slot busy waits for one (back-pressure,
    counted in ``capacity/tool_wait_s``). 0 = the CPU count of the node it runs on."""

    service: str = "in_process"
    """Where the rollout side (manager, environment workers and sandboxes, judge client)
    runs: "in_process" = in trainer rank 0's process; "local" = rank 0 starts it as its own
    process beside the trainer (python -m megatron_tg.sampling.service) and pulls judged
    batches from it over HTTP; "remote" = a service already started at ``service_url`` (the
    Slurm scripts start one per job on the first rollout node). docs/rollout-service.md."""

    service_url: Optional[str] = None
    """Base URL (http://HOST:PORT) of the rollout service; required with service="remote"."""

    service_poll_s: float = 10.0
    """Longest one request to the rollout service is held open (a call that takes longer is
    polled again): the time within which a dead or unreachable service is noticed."""

    service_start_timeout_s: float = 600.0
    """service="local": seconds the service may take to build its side (start engines, load
    the tokenizer and tasks) before the trainer gives up, naming its log."""

    sampling_seed: Optional[int] = None
    """Seed every generation request: request seed = hash(sampling_seed, prompt position,
    rollout index in the group, turn, piece), sent as SGLang's ``sampling_params.sampling_seed``.
    The same weights then sample the same tokens whatever the timing, so a run killed and
    resumed from a checkpoint regenerates exactly what the uninterrupted run saw (with
    max_staleness=0; with asynchrony, timing decides which weights sample which prompt). The
    embedded engine honours it exactly; SGLang reproduces seeded samples across batch
    compositions only in its deterministic-inference mode (batch-invariant kernels, slower).
    None: the engines' own RNG."""

    stale_policy: str = "drop"
    """What happens to a group older than max_staleness: "drop" it (counted as dropped/stale) or
    "regenerate" its prompt (at most max_retries times, then dropped)."""

    pause_mode: str = "retract"
    """How engines pause for a weight update: "retract" (keep requests, drop their KV and
    recompute it under the new weights; the sync flushes the prefix cache while paused),
    "abort" (cut them; the rollout resubmits the rest of the turn after the update) or
    "in_place" (keep requests and their KV in the running batch; SGLang then refuses any
    flush, so the sync skips it and prefixes cached under the old weights stay in use)."""

    request_timeout_s: float = 600.0
    """Seconds before one generation request to an engine is abandoned and retried."""

    max_retries: int = 3
    """Retries of a failed generation request before its rollout is dropped."""

    tasks: Optional[str] = None
    """JSONL file of tasks, one per line; relative paths resolve against the working directory.
    None = no task file (only for components that supply their own prompts, e.g. tests)."""

    sandbox: str = "bwrap"
    """Isolation of the tool calls that run model-written code: "bwrap" = bubblewrap with no
    network, only system directories and the Python environment bound read-only; "apptainer",
    "enroot", "pyxis" = the task's per-instance container image (``image`` in the task row)
    run by that runtime; "none" = run directly (needs ``allow_unsandboxed``)."""

    sandbox_url: Optional[str] = None
    """Base URL of a remote environment worker (``python -m megatron_tg.agent.remote serve``
    on a CPU node) that holds the workspaces, runs the tools and grades; None = run them in
    this process."""

    sandbox_token_file: Optional[str] = None
    """File holding the shared secret the remote environment worker requires (sent as a
    bearer token); required with ``sandbox_url``."""

    api_key_file: Optional[str] = None
    """File (mode 0600) holding the job's API key (``python -m megatron_tg.auth new DIR``;
    the Slurm scripts make one per job): the rollout service, the engines and the router
    require it, and this side sends it (docs/security.md). None: ``$TG_API_KEY_FILE`` if set;
    else engines this process starts get a fresh key of their own, and servers given by URL
    are called without one. Only the path is ever logged or saved, never the key."""

    repos_root: Optional[str] = None
    """Directory holding the local git mirrors (or source trees) that task rows name in
    ``repo``; a row whose repo resolves outside it is refused. None = the task file's own
    directory."""

    workspace_root: Optional[str] = None
    """Where workspaces are created (one directory per run, removed at exit; those of a dead
    run are removed when the next one starts). None = the system temp directory."""

    allow_unsandboxed: bool = False
    """Explicit consent to ``sandbox=none``; model-written code then runs with your permissions."""

    tool_call_reading: str = "strict"
    """How the harness (which executes calls) and the judge (which grades them) read the
    model's Qwen3-Coder XML tool calls: "strict" = only calls every parser reads the same way
    (ambiguous or unterminated ones are errors, never rewarded); "sglang" = SGLang's own
    qwen3_coder detector, exactly what an SGLang deployment executes (needs sglang installed).
    See megatron_tg/chat/tool_reading.py for the three inputs on which they differ."""

    tool_timeout_s: float = 30.0
    """Wall-clock limit of one run_shell / run_tests call; also its CPU-seconds limit."""

    tool_memory_mb: int = 2048
    """Memory of one tool call: resident memory summed over all its processes, and the
    address space of each (prlimit --as)."""

    tool_max_procs: int = 64
    """Most processes a sandboxed command may run at once, counted over the whole call (its
    pid namespace) and per user (prlimit --nproc; stops fork bombs)."""

    tool_disk_mb: int = 1024
    """Disk quota of one workspace (allocated blocks): a command that grows it past this is
    killed, and a workspace over it is graded as failing."""

    tool_output_chars: int = 8192
    """Most characters of one tool result shown to the agent; the rest is cut with a note."""

    test_timeout_s: float = 60.0
    """Wall-clock limit of the hidden tests run after the last turn (the pass-rate reward)."""

    search_default_lines: int = 5
    """Lines the search tool returns when the call omits its ``lines`` argument."""

    router_url: Optional[str] = None
    """An sglang-router in front of ``server_urls``: generation goes through it, while admin
    calls (pause, weight updates) still go to every server in ``server_urls``."""

    sync_master_address: Optional[str] = None
    """Address the engines reach trainer rank 0 at for the weight-update group (SGLang's
    ``init_weights_update_group``); default: loopback for embedded engines, else this host."""

    sync_backend: str = "auto"
    """Transport of the weight-update group: "nccl" (GPU tensors; SGLang's default on
    clusters), "gloo" (CPU tensors; the embedded engines) or "auto" = nccl when the trainer
    has a GPU and the engines are SGLang servers, else gloo."""

    sync_bucket_mb: int = 512
    """Weight sync bucket size in MiB (one broadcast per bucket, or with
    ``placement="colocated"`` one ``/update_weights_from_tensor`` request per bucket; rank 0
    holds one bucket)."""

    sync_verify_coverage: bool = True
    """At the first sync, prove every engine weight is written by a sync: SGLang's weight
    checker snapshots the engine, overwrites every weight with noise, the same weights are
    pushed again, and the engine compares against the snapshot (catches names the loader
    skips). Costs one extra sync, once."""

    sync_probe_interval: int = 1
    """Every this many syncs, each engine's log-probs of a fixed sequence are compared with
    the trainer's; a mismatch above sync_probe_tol stops training naming the engine. 0 = never."""

    sync_probe_tol: float = 0.1
    """Largest mean |engine - trainer| log-prob difference over the probe sequence that still
    counts as the same weights. Rounding (bf16 kernels that differ between trainer and
    engine) must stay below it; a skipped or wrong tensor moves log-probs far more. It
    cannot see a one-step-stale engine (that is what the weight version check is for)."""

    sync_probe_tokens: int = 32
    """Length of the probe sequence (one prompt-log-prob request per engine per probe)."""

    def validate(self) -> None:
        check_choice("rollout.engine", self.engine, ENGINES)
        check_choice("rollout.sandbox", self.sandbox, SANDBOXES)
        check_choice("rollout.tool_call_reading", self.tool_call_reading, TOOL_CALL_READINGS)
        check_choice("rollout.stale_policy", self.stale_policy, STALE_POLICIES)
        check_choice("rollout.pause_mode", self.pause_mode, PAUSE_MODES)
        check_choice("rollout.sync_backend", self.sync_backend, SYNC_BACKENDS)
        check_range("rollout.max_inflight_rollouts", self.max_inflight_rollouts, ge=0)
        check_range("rollout.env_workers_per_node", self.env_workers_per_node, ge=0)
        check_choice("rollout.service", self.service, SERVICE_MODES)
        check_range("rollout.service_poll_s", self.service_poll_s, gt=0)
        check_range("rollout.service_start_timeout_s", self.service_start_timeout_s, gt=0)
        if self.service == "remote" and not self.service_url:
            raise ConfigError("rollout.service_url: required with rollout.service='remote' "
                              "(http://HOST:PORT of a running rollout service); got None")
        if self.service_url is not None and not self.service_url.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.service_url: must start with http:// (http://HOST:PORT); "
                              f"got {self.service_url!r}")
        if self.max_inflight_rollouts and self.max_inflight_rollouts < self.group_size:
            raise ConfigError(f"rollout.max_inflight_rollouts: must be 0 (auto) or >= rollout.group_size="
                              f"{self.group_size} (room for one whole group); got {self.max_inflight_rollouts}")
        for name in ("tool_timeout_s", "test_timeout_s"):
            check_range(f"rollout.{name}", getattr(self, name), gt=0)
        for name in ("tool_memory_mb", "tool_max_procs", "tool_disk_mb", "tool_output_chars", "search_default_lines"):
            check_range(f"rollout.{name}", getattr(self, name), ge=1)
        for name in ("num_engines", "engine_tp", "prompts_per_step", "max_new_tokens", "max_turns",
                     "buffer_size", "sync_bucket_mb"):
            check_range(f"rollout.{name}", getattr(self, name), ge=1)
        # A group of one has advantage 0 whatever its reward: GRPO would learn nothing.
        check_range("rollout.group_size", self.group_size, ge=2)
        check_range("rollout.temperature", self.temperature, gt=0)
        check_range("rollout.top_p", self.top_p, gt=0, le=1)
        check_range("rollout.max_context_tokens", self.max_context_tokens, ge=self.max_new_tokens)
        check_range("rollout.max_staleness", self.max_staleness, ge=0)
        check_range("rollout.request_timeout_s", self.request_timeout_s, gt=0)
        check_range("rollout.max_retries", self.max_retries, ge=0)
        check_range("rollout.sync_probe_interval", self.sync_probe_interval, ge=0)
        check_range("rollout.sync_probe_tol", self.sync_probe_tol, gt=0)
        check_range("rollout.sync_probe_tokens", self.sync_probe_tokens, ge=2)
        self._validate_placement()
        if self.buffer_size < self.prompts_per_step:
            raise ConfigError(f"rollout.buffer_size: must hold one step's groups "
                              f"(rollout.prompts_per_step={self.prompts_per_step}); got {self.buffer_size}")
        if self.sandbox_url is not None and not self.sandbox_token_file:
            raise ConfigError(f"rollout.sandbox_token_file: required with rollout.sandbox_url="
                              f"{self.sandbox_url!r} (the worker runs model-written code); got None")
        if self.sandbox == "none" and not self.allow_unsandboxed:
            raise ConfigError("rollout.sandbox: 'none' runs model-written code unconfined; "
                              "set rollout.allow_unsandboxed=true to accept that; got 'none'")

    def _validate_placement(self) -> None:
        """Colocated engines share the trainer's GPUs: what cannot work that way is refused
        here, naming the field that has to change."""
        check_choice("rollout.placement", self.placement, PLACEMENTS)
        if self.placement != "colocated":
            return
        why = "rollout.placement='colocated'"
        if self.max_staleness != 0:  # generation and training take turns on the same GPUs
            raise ConfigError(f"rollout.max_staleness: must be 0 with {why} (the engines cannot "
                              f"generate while the trainer trains on their GPUs); got {self.max_staleness}")


FEEDBACK_PLACEHOLDER = "{feedback}"
# Roles the chat template can give the inserted feedback message; the same tuple as
# megatron_tg.chat.feedback.FRAMINGS (kept apart so importing the config stays light; a test
# checks they agree).
FEEDBACK_ROLES = ("user", "system")


@dataclass
class JudgeConfig:
    """Scores each rollout against a rubric of criteria and returns feedback for failed ones."""

    rubric: Optional[str] = None
    """YAML rubric: the criteria, their checks and their feedback strings. None = only the
    primary task criterion (tests pass), no style criteria."""

    endpoint: Optional[str] = None
    """OpenAI-compatible base URL of an LLM judge for criteria the rubric marks as judged;
    None = rule-based criteria only."""

    model: Optional[str] = None
    """Model name sent to ``endpoint``; required when ``endpoint`` is set."""

    api_key_file: Optional[str] = None
    """File (mode 0600) holding the judge server's API key, sent as a bearer token (the Slurm
    scripts set it to the job's key when they serve the judge). None: no key."""

    timeout_s: float = 120.0
    """Seconds before a judge request is abandoned and retried."""

    max_retries: int = 3
    """Retries of a failed judge request; after that the criterion counts as not judged and
    that rollout gets neither reward nor feedback for it (never a silent pass)."""

    max_concurrency: int = 16
    """Judge requests in flight at once (the judge server's batch; more only queue there)."""

    max_transcript_chars: int = 200_000
    """Characters of transcript per judge request; longer transcripts lose their middle
    (marked), so a long rollout is judged on its task and its last turns instead of being
    dropped. A rubric criterion's ``judge_budget_chars`` lowers it for that criterion."""

    overflow_retries: int = 2
    """Re-sends with a shorter transcript when the judge answers that the prompt exceeds its
    context (HTTP 400 "context length"); not counted against ``max_retries``."""

    feedback_framing: str = "Feedback on your next response: {feedback}"
    """Text of the message inserted right before a failing turn in the expert's context;
    ``{feedback}`` is replaced by the failed criteria's feedback strings."""

    feedback_role: str = "user"
    """Chat role of that inserted message: "user" or "system"."""

    def validate(self) -> None:
        if self.endpoint is not None and not self.model:
            raise ConfigError(f"judge.model: required when judge.endpoint is set "
                              f"({self.endpoint!r}); got {self.model!r}")
        check_range("judge.timeout_s", self.timeout_s, gt=0)
        check_range("judge.max_retries", self.max_retries, ge=0)
        check_range("judge.max_concurrency", self.max_concurrency, ge=1)
        check_range("judge.max_transcript_chars", self.max_transcript_chars, ge=1000)
        check_range("judge.overflow_retries", self.overflow_retries, ge=0)
        check_choice("judge.feedback_role", self.feedback_role, FEEDBACK_ROLES)
        if FEEDBACK_PLACEHOLDER not in self.feedback_framing:
            raise ConfigError(f"judge.feedback_framing: must contain {FEEDBACK_PLACEHOLDER}; "
                              f"got {self.feedback_framing!r}")
