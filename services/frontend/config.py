from __future__ import annotations

import dataclasses

from libs.common.config import CommonConfig, opt


@dataclasses.dataclass(frozen=True)
class FrontendConfig(CommonConfig):
    port: int = opt(8000, "HTTP port (OpenAI API, /health, /metrics)", min=0, max=65535)
    grpc_port: int = opt(-1, "gRPC Generate API port (-1 = off, 0 = any free port)", min=-1, max=65535)
    scheduler: str = opt("127.0.0.1:7001", "scheduler address host:port")
    meta_store: str = opt("127.0.0.1:7000", "meta store address host:port")
    model: str = opt("smollm2", "model name or directory (tokenizer, chat template); 'fake' for fake engines")
    served_model_name: str = opt("", "model name in the API (default: --model)")
    api_key: str = opt("", "require this Bearer token (comma-separated list allowed)")
    api_key_file: str = opt("", "file with one accepted API key per line")
    dispatch_timeout_s: float = opt(1.0, "give up on the scheduler after this long (then bypass)", min=0.01)
    bypass_retry_s: float = opt(1.0, "in bypass, ask the scheduler again after this long", min=0.0)
    dispatch_stream: bool = opt(True, "ask the scheduler for placements over one long-lived stream "
                                      "(DispatchStream); off: a unary Dispatch call per request")
    max_resumes: int = opt(3, "resume a request on another instance at most this often after crashes", min=0)
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

    def api_keys(self) -> frozenset[str]:
        keys = {k.strip() for k in self.api_key.split(",") if k.strip()}
        if self.api_key_file:
            with open(self.api_key_file) as f:
                keys |= {line.strip() for line in f if line.strip() and not line.startswith("#")}
        return frozenset(keys)
