// The progress output of tandem-train (rank 0 only): on a terminal one line
// that updates in place every step, with a permanent line every `log_every`
// steps; otherwise (a file, a pipe, CI) only the permanent lines.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "tools/train/trainer.h"

namespace tandem::train {

class Progress {
 public:
  // mode: auto (line on a terminal, plain otherwise) | line | plain | quiet
  Progress(std::FILE* out, const std::string& mode, int64_t total_steps, int64_t log_every);
  ~Progress();

  void step(const StepStats& s, bool force_log = false);
  // A whole line of its own (clears an in-place line first).
  void message(const std::string& text);

  static std::string format(const StepStats& s, int64_t total_steps);

 private:
  void clear_line();
  std::FILE* out_;
  bool in_place_ = false;
  bool quiet_ = false;
  bool line_open_ = false;
  int64_t total_;
  int64_t log_every_;
};

}  // namespace tandem::train
