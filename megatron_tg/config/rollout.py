"""Generation of agent rollouts, and the judge that scores them and writes feedback."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_tg.config.base import ConfigError, check_choice, check_range

ENGINES = ("embedded", "sglang")
SANDBOXES = ("bwrap", "none")
STALE_POLICIES = ("drop", "regenerate")
PAUSE_MODES = ("in_place", "retract", "abort")


@dataclass
class RolloutConfig:
    """Who generates rollouts, how many, how long they may run, and how stale they may be."""

    engine: str = "embedded"
    """"embedded" = generate with the trainer's own model in-process (CPU tests, tiny models);
    "sglang" = separate SGLang servers that receive weights after every step (GPU clusters)."""

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

    pause_mode: str = "in_place"
    """How engines pause for an in-flight weight update: "in_place" (keep running requests and
    their KV cache), "retract" (keep requests, drop and recompute the cache) or "abort" (cut
    them; the rollout resubmits the rest of the turn after the update)."""

    request_timeout_s: float = 600.0
    """Seconds before one generation request to an engine is abandoned and retried."""

    max_retries: int = 3
    """Retries of a failed generation request before its rollout is dropped."""

    tasks: Optional[str] = None
    """JSONL file of tasks, one per line; relative paths resolve against the working directory.
    None = no task file (only for components that supply their own prompts, e.g. tests)."""

    sandbox: str = "bwrap"
    """Isolation of the tool calls that run model-written code: "bwrap" = bubblewrap with no
    network and a read-only root; "none" = run directly (needs ``allow_unsandboxed``)."""

    allow_unsandboxed: bool = False
    """Explicit consent to ``sandbox=none``; model-written code then runs with your permissions."""

    tool_timeout_s: float = 30.0
    """Wall-clock limit of one run_shell / run_tests call; also its CPU-seconds limit."""

    tool_memory_mb: int = 2048
    """Address-space limit of each sandboxed process (prlimit --as)."""

    tool_max_procs: int = 64
    """Most processes a sandboxed command may run at once (prlimit --nproc; stops fork bombs)."""

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

    sync_bucket_mb: int = 512
    """Weight sync bucket size in MiB (one broadcast per bucket)."""

    def validate(self) -> None:
        check_choice("rollout.engine", self.engine, ENGINES)
        check_choice("rollout.sandbox", self.sandbox, SANDBOXES)
        check_choice("rollout.stale_policy", self.stale_policy, STALE_POLICIES)
        check_choice("rollout.pause_mode", self.pause_mode, PAUSE_MODES)
        check_range("rollout.max_inflight_rollouts", self.max_inflight_rollouts, ge=0)
        if self.max_inflight_rollouts and self.max_inflight_rollouts < self.group_size:
            raise ConfigError(f"rollout.max_inflight_rollouts: must be 0 (auto) or >= rollout.group_size="
                              f"{self.group_size} (room for one whole group); got {self.max_inflight_rollouts}")
        for name in ("tool_timeout_s", "test_timeout_s"):
            check_range(f"rollout.{name}", getattr(self, name), gt=0)
        for name in ("tool_memory_mb", "tool_max_procs", "tool_output_chars", "search_default_lines"):
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
        if self.buffer_size < self.prompts_per_step:
            raise ConfigError(f"rollout.buffer_size: must hold one step's groups "
                              f"(rollout.prompts_per_step={self.prompts_per_step}); got {self.buffer_size}")
        if self.sandbox == "none" and not self.allow_unsandboxed:
            raise ConfigError("rollout.sandbox: 'none' runs model-written code unconfined; "
                              "set rollout.allow_unsandboxed=true to accept that; got 'none'")


FEEDBACK_PLACEHOLDER = "{feedback}"
# Roles the chat template can give the inserted feedback message; the same tuple as
# megatron_tg.chat.framing.FRAMINGS (kept apart so importing the config stays light; a test
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

    timeout_s: float = 120.0
    """Seconds before a judge request is abandoned and retried."""

    max_retries: int = 3
    """Retries of a failed judge request; after that the criterion counts as not judged and
    that rollout gets neither reward nor feedback for it (never a silent pass)."""

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
        check_choice("judge.feedback_role", self.feedback_role, FEEDBACK_ROLES)
        if FEEDBACK_PLACEHOLDER not in self.feedback_framing:
            raise ConfigError(f"judge.feedback_framing: must contain {FEEDBACK_PLACEHOLDER}; "
                              f"got {self.feedback_framing!r}")
