// tandem-train: the main job. See tools/train/trainer.h for what it runs and
// README.md ("Quick start", "Launching with mpirun") for how.
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "tandem/comm/backend.h"
#include "tandem/runtime/error.h"
#include "tools/train/options.h"
#include "tools/train/trainer.h"

int main(int argc, char** argv) {
  using namespace tandem::train;
  Command command;
  try {
    command = parse_command_line(std::vector<std::string>(argv, argv + argc));
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-train: error: {}\n", e.what());
    return 2;
  }
  if (command.kind == Command::Kind::Help) {
    fmt::print("{}", command.help);
    return 0;
  }
  try {
    if (command.kind == Command::Kind::Export) {
      export_checkpoint(command.export_from, command.export_to,
                        command.export_dtype == "bf16" ? tandem::DType::BF16 : tandem::DType::F32);
      fmt::print("tandem-train: wrote '{}' from '{}'\n", command.export_to, command.export_from);
      return 0;
    }
    run_training(command.options);
    tandem::finalize_backend(command.options.backend);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-train: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
