// A user's model with tandem as a Meson subproject: a two-layer MLP learns to
// reproduce its input (README, "Writing a model"). Exits non-zero unless the
// loss falls to a tenth of where it started.
#include <tandem/tandem.h>

#include <cstdio>

using namespace tandem;

struct Mlp final : Module {
  std::shared_ptr<nn::Linear> up, down;
  Mlp(int64_t d, int64_t hidden, Generator& gen) : Module("Mlp") {
    up = register_module("up",
                         nn::make<nn::Linear>({.in_features = d, .out_features = hidden}, gen));
    down = register_module("down",
                           nn::make<nn::Linear>({.in_features = hidden, .out_features = d}, gen));
  }
  std::vector<Tensor> forward(Args& args) override {
    return {(*down)(gelu((*up)(args.positional[0])))};
  }
};

int main() {
  Generator gen(0);
  auto model = std::make_shared<Mlp>(16, 64, gen);
  optim::AdamW opt(model->named_parameters(), {.lr = 1e-2});
  Tensor x = ops::randn({64, 16}, gen);
  double first = 0, loss_value = 0;
  for (int step = 0; step < 200; ++step) {
    Tensor loss = mean(pow(sub((*model)(x), x), 2.0));
    model->zero_grad();
    backward(loss);
    opt.step();
    loss_value = loss.item_double();
    if (step == 0) first = loss_value;
  }
  std::printf("loss %.4f -> %.4f\n", first, loss_value);
  return loss_value < 0.1 * first ? 0 : 1;
}
