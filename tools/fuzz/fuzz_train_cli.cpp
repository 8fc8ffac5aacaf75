// libFuzzer target: tandem-train's command line. The input is split at NUL
// bytes into arguments (so seeds are readable: `--dp\0 2\0 --cp\0 …`); the
// parser and the layout validation must either accept the arguments or throw
// tandem::Error — any other exception, a crash or a hang is a finding. The
// data file and checkpoints are not opened (the fuzzer must not read
// arbitrary paths); their errors are covered by tests/train.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tandem/runtime/error.h"
#include "tools/train/options.h"
#include "tools/train/trainer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> args = {"tandem-train"};
  std::string current;
  for (size_t i = 0; i < size && args.size() < 64; ++i) {
    if (data[i] == 0) {
      args.push_back(current);
      current.clear();
    } else {
      current.push_back(static_cast<char>(data[i]));
    }
  }
  if (!current.empty()) args.push_back(current);
  try {
    tandem::train::Command c = tandem::train::parse_command_line(args);
    if (c.kind != tandem::train::Command::Kind::Train) return 0;
    const tandem::train::TrainOptions& o = c.options;
    const int64_t world = o.ranks > 0 ? o.ranks : int64_t{o.dp} * o.ep * o.cp * o.tp;
    if (world > 0 && world <= 1 << 20) tandem::train::validate(o, static_cast<int>(world));
  } catch (const tandem::Error&) {
  }
  return 0;
}
