// Process-wide runtime settings, read once from the environment and settable by
// tests. Note [Bounded waits]: every blocking wait in tandem takes its deadline
// from wait_timeout(); on expiry it throws TimeoutError naming who waited for what.
#pragma once

#include <chrono>

namespace tandem {

enum class CpuStreamMode { Inline, Async };

// TANDEM_WAIT_TIMEOUT_S (default 600 s).
std::chrono::milliseconds wait_timeout();
void set_wait_timeout(std::chrono::milliseconds timeout);

// Mode of each thread's default CPU stream: TANDEM_CPU_STREAMS=inline|async
// (default inline: ops run on the calling thread). Async makes every default
// stream a FIFO executor, which the test suite uses to flush out missing
// synchronisation.
CpuStreamMode default_cpu_stream_mode();
void set_default_cpu_stream_mode(CpuStreamMode mode);

}  // namespace tandem
