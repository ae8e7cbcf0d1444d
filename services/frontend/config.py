from __future__ import annotations

import dataclasses

from libs.common.config import CommonConfig, ConfigError, opt


@dataclasses.dataclass(frozen=True)
class FrontendConfig(CommonConfig):
    port: int = opt(8000, "HTTP port (OpenAI API, /health, /metrics)", min=0, max=65535)
    grpc_port: int = opt(-1, "gRPC Generate API port (-1 = off, 0 = any free port)", min=-1, max=65535)
    scheduler: str = opt("127.0.0.1:7001", "scheduler address host:port")
    meta_store: str = opt("127.0.0.1:7000", "meta store address host:port")
    model: str = opt("smollm2", "model name or directory (tokenizer, chat template); 'fake' for fake engines")
    served_model_name: str = opt("", "model name in the API (default: --model); a request naming another is a 404")
    tool_call_parser: str = opt("", "read tool_choice 'auto' calls from the model's text with this parser (vLLM's, "
                                "imported at start: the vllm extra); without one, 'auto' with tools is a 400",
                                choices=("", "hermes"))
    api_key: str = opt("", "require this Bearer token (comma-separated list allowed)")
    api_key_file: str = opt("", "file with one accepted API key per line")
    require_api_key: bool = opt(False, "refuse to start unless an API key is configured (--api-key, "
                                "--api-key-file or --priority-api-key): a public deployment is never open by "
                                "mistake (compose sets it)")
    priority_api_key: str = opt("", "API keys (comma-separated) whose requests may ask for high priority (the "
                                "priority field, X-Priority, gRPC priority); they are accepted API keys too. Other "
                                "clients asking for it get 403")
    max_in_flight: int = opt(512, "most requests generating at once on this frontend (HTTP and gRPC); more get "
                             "429 with Retry-After (0 = no bound)", min=0)
    client_timeout_s: float = opt(30.0, "a client has this long to send a request's headers, and again its body "
                                  "(then the connection is closed, or 408); and an SSE stream's client this long to "
                                  "take each event (else the request is aborted)", min=0.1)
    shutdown_grace_s: float = opt(120.0, "on SIGTERM: stop taking requests (503, /health 503) and let the streams "
                                  "under way finish for up to this long", min=0.0)
    dispatch_timeout_s: float = opt(1.0, "give up on the scheduler after this long (then bypass)", min=0.01)
    bypass_retry_s: float = opt(1.0, "in bypass, ask the scheduler again after this long", min=0.0)
    bypass_prefix_index: bool = opt(True, "while the scheduler's policy is prefix-aware, follow every instance's KV "
                                    "events, so that bypass dispatch (the same policy) counts cached prefixes "
                                    "from its first request (off: bypass sees no prefix)")
    dispatch_stream: bool = opt(True, "ask the scheduler for placements over one long-lived stream "
                                      "(DispatchStream); off: a unary Dispatch call per request")
    max_resumes: int = opt(1, "a request whose instance died, stalled or failed it resumes on another instance at "
                           "most this often (its retry budget); then it fails alone with its error", min=0)
    stall_timeout_s: float = opt(60.0, "a request whose instance stream brings nothing for this long is checked with "
                                 "the instance, and resumed elsewhere if the instance lost it or its engine makes no "
                                 "step (0 = never)", min=0.0)
    keep_alive_s: float = opt(75.0, "close idle HTTP keep-alive connections after this long (s); longer than "
                              "clients' pool expiry, so a reused connection is not closed under a request", min=0.1)
    status_interval_s: float = opt(0.5, "take each instance's status from the meta store at most this often (the "
                                   "frontend's view serves bypass dispatch and /metrics; 0 = every report)", min=0.0)
    nonstream_flush_ms: int = opt(500, "non-streaming requests: instances send tokens after the first together at "
                                  "most this often (fewer messages; 0 = each token at once)", min=0)
    default_max_model_len: int = opt(2048, "context length when no instance reports one", min=16)
    max_body_bytes: int = opt(8 << 20, "largest request accepted: HTTP body (bigger: 413) and gRPC message "
                              "(bigger: RESOURCE_EXHAUSTED)", min=1024)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.rstrip("/").rsplit("/", 1)[-1]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.require_api_key and not (self.api_key.strip(", ") or self.api_key_file or
                                         self.priority_api_key.strip(", ")):
            raise ConfigError("an API key is required (--require-api-key): give --api-key, --api-key-file or "
                              "--priority-api-key (compose: ./init.sh writes one into .env)")

    def keys(self):
        from services.frontend.auth import Keys

        priority = frozenset(k.strip() for k in self.priority_api_key.split(",") if k.strip())
        required = self.api_keys()
        return Keys(required | priority if required else frozenset(), priority)

    def api_keys(self) -> frozenset[str]:
        keys = {k.strip() for k in self.api_key.split(",") if k.strip()}
        if self.api_key_file:
            with open(self.api_key_file) as f:
                keys |= {line.strip() for line in f if line.strip() and not line.startswith("#")}
        return frozenset(keys)
