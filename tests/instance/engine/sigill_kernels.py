"""A stand-in for a kernel library built for an instruction set this CPU
lacks: importing it kills the process with SIGILL, as ``import vllm._C`` did
on an AVX2 CPU. Only a probe's child process may import it (the probe tests
point vllm_kernels' probes here); never import it in a test process."""

import os
import resource
import signal

resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file
os.kill(os.getpid(), signal.SIGILL)
