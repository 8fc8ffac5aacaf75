// The command line of tandem-train (CLI11), separate from main() so that the
// tests and the command-line fuzzer can drive the parser.
#pragma once

#include <string>
#include <vector>

#include "tools/train/trainer.h"

namespace tandem::train {

struct Command {
  enum class Kind { Train, Export, Help } kind = Kind::Train;
  TrainOptions options;
  std::string export_from, export_to;
  std::string export_dtype = "f32";
  std::string help;  // the text to print for --help
};

// Parses argv (argv[0] = program name). Throws tandem::Error with CLI11's
// message (and the usage hint) for a bad command line.
Command parse_command_line(const std::vector<std::string>& args);

}  // namespace tandem::train
