// The Exchange of parallel/collectives.h: one collective as three autograd
// nodes (Note [Exchange windows]).
#include "tandem/autograd/function.h"
#include "tandem/parallel/collectives.h"
#include "tandem/runtime/error.h"

namespace tandem {
namespace {

void start_forward(Exchange& ex, const Tensor& x) {
  ex.forward_pending = ex.forward(x);
  ex.forward_pending.progress_in_background();  // Note [Progress without a waiter]
}

// Note [Exchange windows]: the three nodes.
struct ExchangeOpen final : Function {
  std::shared_ptr<Exchange> ex;
  const char* name() const override { return "ExchangeOpenBackward"; }
  bool always_record() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    if (!ex->backward_pending.launched()) return {g[0]};
    Tensor dx = ex->backward_pending.wait();
    ex->backward_pending = {};
    return {dx};
  }
};

struct ExchangeLaunch final : Function {
  std::shared_ptr<Exchange> ex;
  const char* name() const override { return "ExchangeLaunchBackward"; }
  bool always_record() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    if (!ex->forward_pending.launched()) start_forward(*ex, in[0]);
    return {ex->forward_pending.in_flight()};  // in flight until Wait
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    TANDEM_CHECK(!ex->backward_pending.launched(),
                 "[parallel::Exchange] expected one backward per forward of {}, got a second "
                 "before the first was waited",
                 ex->what);
    ex->backward_pending = ex->backward(g[0]);
    ex->backward_pending.progress_in_background();
    return {ex->backward_pending.in_flight()};  // in flight until Open
  }
};

struct ExchangeWait final : Function {
  std::shared_ptr<Exchange> ex;
  const char* name() const override { return "ExchangeWaitBackward"; }
  bool always_record() const override { return true; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    TANDEM_CHECK(ex->forward_pending.launched(),
                 "[parallel::Exchange] expected {} to be launched before its wait", ex->what);
    const Shape raw = ex->forward_pending.in_flight().shape();
    TANDEM_CHECK(in[0].shape() == raw,
                 "[parallel::Exchange] expected the code between launch and wait of {} to pass "
                 "the in-flight buffer {} on, got {}",
                 ex->what, raw, in[0].shape());
    Tensor y = ex->forward_pending.wait();
    ex->forward_pending = {};
    return {y};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    return {g[0]};
  }
};

template <class F>
Tensor apply_exchange(const std::shared_ptr<Exchange>& ex, const Tensor& x) {
  TANDEM_CHECK(ex != nullptr, "[parallel::Exchange] expected an exchange, got null");
  auto fn = std::make_shared<F>();
  fn->ex = ex;
  return Function::apply(fn, {x})[0];
}

}  // namespace

Tensor exchange_open(const std::shared_ptr<Exchange>& ex, const Tensor& x) {
  return apply_exchange<ExchangeOpen>(ex, x);
}

void exchange_start(const std::shared_ptr<Exchange>& ex, const Tensor& x) {
  TANDEM_CHECK(ex && ex->forward, "[parallel::Exchange] expected an exchange with a launcher");
  TANDEM_CHECK(!ex->forward_pending.launched(),
               "[parallel::Exchange] expected {} to be started once, got a second start", ex->what);
  NoGradGuard no_grad;
  start_forward(*ex, x);
}

Tensor exchange_launch(const std::shared_ptr<Exchange>& ex, const Tensor& x) {
  TANDEM_CHECK(ex && ex->forward && ex->backward,
               "[parallel::Exchange] expected an exchange with forward and backward launchers");
  return apply_exchange<ExchangeLaunch>(ex, x);
}

Tensor exchange_wait(const std::shared_ptr<Exchange>& ex, const Tensor& in_flight) {
  return apply_exchange<ExchangeWait>(ex, in_flight);
}

void exchange_drop(const std::shared_ptr<Exchange>& ex) {
  TANDEM_CHECK(ex && ex->forward_pending.launched(),
               "[parallel::Exchange] expected a started exchange to drop");
  NoGradGuard no_grad;
  ex->forward_pending.wait();
  ex->forward_pending = {};
}

}  // namespace tandem
