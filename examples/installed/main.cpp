// A user's model trained with data, context and expert parallelism: 8 ranks as
// threads of this process, on a dp 2 x ep 2 x cp 2 mesh, built against an
// installed tandem. The task, predicting the previous token, needs the token
// that sits on the other context-parallel rank at every shard boundary. Exits
// non-zero unless the loss falls to half of where it started.
#include <tandem/tandem.h>

#include <atomic>
#include <cstdio>

using namespace tandem;

constexpr int64_t kVocab = 16, kDim = 32, kSeq = 32, kBatch = 4, kSteps = 80;

struct TinyMoE final : Module {
  std::shared_ptr<nn::Embedding> tok, pos;
  std::shared_ptr<nn::TransformerBlock> block;
  std::shared_ptr<nn::Linear> head;
  explicit TinyMoE(Generator& gen) : Module("TinyMoE") {
    auto table = [&](int64_t rows) {
      return nn::make<nn::Embedding>({.num_embeddings = rows, .dim = kDim, .init_std = 0.02}, gen);
    };
    tok = register_module("tok", table(kVocab));
    pos = register_module("pos", table(kSeq));
    nn::TransformerBlockConfig moe_block{.d_model = kDim, .n_heads = 4, .hidden = 64, .experts = 4};
    block = register_module("block", nn::make<nn::TransformerBlock>(moe_block, gen));
    head = register_module(
        "head",
        nn::make<nn::Linear>({.in_features = kDim, .out_features = kVocab, .bias = false}, gen));
  }
  // tokens (B, S_local) and their global positions (S_local) → {logits, MoE aux loss}.
  std::vector<Tensor> forward(Args& args) override {
    Tensor x = add((*tok)(args.positional[0]), (*pos)(args.positional[1]));
    auto [y, aux_loss] = nn::call_with_aux(*block, Args{x});
    return {(*head)(y), aux_loss};
  }
};

int main() {
  std::atomic<double> first{0}, last{0};
  run_ranks(8, [&](ProcessGroupPtr world) {
    DeviceMesh mesh(world, {2, 2, 2}, {"dp", "ep", "cp"});
    Generator init(0);  // the same weights everywhere; the styles keep each rank's part
    auto model = std::make_shared<TinyMoE>(init);
    ContextParallel{}.apply(model->block->attn()->core(), mesh.slice("cp"));
    expert_parallel(model->block->moe(), mesh.slice("ep"));

    optim::AdamW opt(model->parameters(), {.lr = 1e-2});

    const int cp = 2, cp_rank = mesh.get_local_rank("cp");
    const int64_t data_rank = mesh.get_local_rank("dp") * 2 + mesh.get_local_rank("ep");
    Tensor positions = shard_sequence(ops::arange(0, kSeq, 1, DType::I64), 0, cp, cp_rank, false);
    for (int64_t step = 0; step < kSteps; ++step) {
      Generator data(1000 + step * 4 + data_rank);  // each (dp, ep) pair its own batch
      Tensor tokens = ops::to(ops::mul(ops::rand({kBatch, kSeq}, data), kVocab), DType::I64);
      Tensor targets = ops::cat(
          {ops::full({kBatch, 1}, -100, DType::I64), ops::narrow(tokens, 1, 0, kSeq - 1)}, 1);
      tokens = shard_sequence(tokens, 1, cp, cp_rank, false);
      targets = shard_sequence(targets, 1, cp, cp_rank, false);

      auto [logits, aux_loss] = nn::call_with_aux(*model, Args{tokens, positions});
      Tensor ce = cross_entropy(reshape(logits, {-1, kVocab}), reshape(targets, {-1}));
      model->zero_grad();
      backward(add(ce, mul(aux_loss, 0.01)));
      // The mean over the replicas: experts over (dp, cp), the rest over all three.
      reduce_gradients(model->parameters(), mesh, {"dp", "ep", "cp"}, RedOp::Avg);
      opt.step();
      if (world->rank() == 0 && (step == 0 || step == kSteps - 1)) {
        (step == 0 ? first : last) = ce.item_double();
        std::printf("step %3lld  loss %.3f\n", static_cast<long long>(step), ce.item_double());
      }
    }
  });
  return last < 0.5 * first ? 0 : 1;
}
