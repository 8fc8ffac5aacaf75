#include "tandem/autograd/checkpoint.h"

#include "tandem/autograd/call_data.h"
#include "tandem/autograd/engine.h"
#include "tandem/autograd/function.h"
#include "tandem/runtime/recompute_flag.h"

namespace tandem {
namespace {

// Note [Random draws under checkpoint]: the checkpoints active on this
// thread, innermost last; each either logs its forward's draws or replays
// them during its re-run.
struct DrawFrame {
  std::vector<RandomDraw>* log;
  bool replay;
  size_t next = 0;
};
thread_local std::vector<DrawFrame> draw_frames;

class DrawScope {
 public:
  DrawScope(std::vector<RandomDraw>* log, bool replay) {
    draw_frames.push_back(DrawFrame{log, replay});
  }
  ~DrawScope() { draw_frames.pop_back(); }
  DrawScope(const DrawScope&) = delete;
  DrawScope& operator=(const DrawScope&) = delete;
};

struct CheckpointFunction final : Function {
  CheckpointFn fn;
  std::vector<Tensor> inputs;     // detached; re-run in backward
  std::vector<RandomDraw> draws;  // made by the forward, replayed by the re-run
  CallDataStack call_data;        // what the forward saw (Note [Per-call data])

  const char* name() const override { return "CheckpointBackward"; }
  bool always_record() const override { return true; }
  bool accepts_undefined_grads() const override { return true; }

  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    for (const Tensor& t : in)
      inputs.push_back(detach(t));
    call_data = call_data_snapshot();
    DrawScope scope(&draws, false);
    return fn(in);
  }

  std::vector<Tensor> backward(FunctionCtx& ctx, const std::vector<Tensor>& grads) override {
    std::vector<Tensor> leaves;
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor x = detach(inputs[i]);
      if (ctx.needs_input_grad[i]) set_requires_grad(x, true);
      leaves.push_back(x);
    }
    std::vector<Tensor> outs;
    {
      RecomputeGuard recompute;
      EnableGradGuard enable;
      CallDataRestore data(call_data);
      DrawScope scope(&draws, true);
      outs = fn(leaves);
      TANDEM_CHECK(draw_frames.back().next == draws.size(),
                   "[autograd::checkpoint] expected the re-run to make the forward's {} random "
                   "draw(s), got {}",
                   draws.size(), draw_frames.back().next);
    }
    std::vector<Tensor> roots, seeds;
    for (size_t i = 0; i < outs.size() && i < grads.size(); ++i) {
      if (grads[i].defined() && requires_grad(outs[i])) {
        roots.push_back(outs[i]);
        seeds.push_back(grads[i]);
      }
    }
    if (!roots.empty()) tandem::backward(roots, seeds);
    std::vector<Tensor> result;
    for (size_t i = 0; i < leaves.size(); ++i) {
      result.push_back(ctx.needs_input_grad[i] ? tandem::grad(leaves[i]) : Tensor());
    }
    inputs.clear();
    draws.clear();
    call_data.clear();
    return result;
  }
};

}  // namespace

RandomDraw draw_random(Generator& gen, uint64_t n) {
  // The innermost replaying checkpoint, if any, supplies the draw; the
  // logging checkpoints inside it record it.
  int replay = -1;
  for (int i = static_cast<int>(draw_frames.size()) - 1; i >= 0; --i) {
    if (draw_frames[i].replay) {
      replay = i;
      break;
    }
  }
  RandomDraw d;
  if (replay >= 0) {
    DrawFrame& f = draw_frames[replay];
    TANDEM_CHECK(f.next < f.log->size(),
                 "[autograd::checkpoint] expected the re-run to make the forward's {} random "
                 "draw(s), got more",
                 f.log->size());
    d = (*f.log)[f.next++];
    TANDEM_CHECK(d.count == n,
                 "[autograd::checkpoint] expected the re-run's random draw {} to take {} numbers "
                 "as in the forward, got {}",
                 f.next - 1, d.count, n);
  } else {
    d.seed = gen.seed();
    d.offset = gen.advance(n);
    d.count = n;
  }
  for (size_t i = static_cast<size_t>(replay + 1); i < draw_frames.size(); ++i) {
    if (!draw_frames[i].replay) draw_frames[i].log->push_back(d);
  }
  return d;
}

// The flag is runtime's (Note [Recompute flag]), so the HookCoordinator sees re-runs.
bool is_recomputing() {
  return thread_is_recomputing();
}
RecomputeGuard::RecomputeGuard() : previous_(set_thread_recomputing(true)) {}
RecomputeGuard::~RecomputeGuard() {
  set_thread_recomputing(previous_);
}

std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs) {
  auto f = std::make_shared<CheckpointFunction>();
  f->fn = std::move(fn);
  return Function::apply(f, inputs);
}

}  // namespace tandem
