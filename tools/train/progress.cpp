#include "tools/train/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include "tandem/runtime/error.h"

namespace tandem::train {

Progress::Progress(std::FILE* out, const std::string& mode, int64_t total_steps, int64_t log_every)
    : out_(out), total_(total_steps), log_every_(std::max<int64_t>(log_every, 1)) {
  TANDEM_CHECK(mode == "auto" || mode == "line" || mode == "plain" || mode == "quiet",
               "[train::Progress] expected a progress mode auto|line|plain|quiet, got '{}'", mode);
  quiet_ = mode == "quiet" || out == nullptr;
  in_place_ = mode == "line" || (mode == "auto" && out != nullptr && isatty(fileno(out)));
}

Progress::~Progress() {
  if (line_open_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

std::string Progress::format(const StepStats& s, int64_t total_steps) {
  const std::string state =
      s.state_bytes > 0
          ? fmt::format("  state {:.1f} MiB/rank", static_cast<double>(s.state_bytes) / (1 << 20))
          : std::string();
  const std::string scale = s.loss_scale > 0 ? fmt::format("  loss scale {:g}{}", s.loss_scale,
                                                           s.skipped ? " (overflow: skipped)" : "")
                                             : std::string();
  return fmt::format(
      "step {:>{}}/{}  loss {:.4f}  acc {:5.1f}%  {:7.0f} tok/s  comm wait {:4.1f}%  peak {:.1f} "
      "MiB{}  lr {:.2e}{}",
      s.step + 1, fmt::formatted_size("{}", total_steps), total_steps, s.loss, 100.0 * s.accuracy,
      s.tokens_per_second, 100.0 * s.comm_wait, static_cast<double>(s.peak_bytes) / (1 << 20),
      state, s.lr, scale);
}

void Progress::clear_line() {
  if (line_open_) {
    std::fputs("\r\033[K", out_);
    line_open_ = false;
  }
}

void Progress::step(const StepStats& s, bool force_log) {
  if (quiet_) return;
  const bool log = force_log || s.step == 0 || (s.step + 1) % log_every_ == 0;
  const std::string text = format(s, total_);
  if (in_place_) {
    clear_line();
    std::fputs(text.c_str(), out_);
    if (log) {
      std::fputc('\n', out_);
    } else {
      line_open_ = true;
    }
  } else if (log) {
    std::fputs(text.c_str(), out_);
    std::fputc('\n', out_);
  }
  std::fflush(out_);
}

void Progress::message(const std::string& text) {
  if (quiet_) return;
  clear_line();
  std::fputs(text.c_str(), out_);
  std::fputc('\n', out_);
  std::fflush(out_);
}

}  // namespace tandem::train
