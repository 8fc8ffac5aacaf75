// The autograd graph: AutogradMeta on tensors, Node (one recorded op), Edge.
//
// Note [The tape]
// ~~~~~~~~~~~~~~~
// While grad mode is on (the default; NoGradGuard turns it off) every
// differentiable op whose inputs require grad appends a Node to the calling
// thread's tape: a named backward type holding exactly the tensors its
// backward needs, and one Edge per input (to the producing node's output slot,
// or to a leaf's AutogradMeta). Each node gets a sequence number from one
// process-wide counter; since a node's inputs exist before it is recorded,
// the recording order is a topological order, and backward() replays the
// nodes reachable from the loss in reverse sequence order. A tape recorded on
// one thread can therefore be replayed on another while the first thread
// records the next micro-batch: the two tapes share no nodes.
//
// Note [Threading model]
// ~~~~~~~~~~~~~~~~~~~~~~
// A node is created by one thread and replayed by at most one thread at a
// time. Parameter (leaf) gradients are written only by backward(): in the
// dual-pipe schedule only the backward worker calls it, while the forward
// worker only reads parameter *values*. Saved tensors are detached (no
// AutogradMeta) so the graph has no cycles, and they are released after the
// replay unless retain_graph is set.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/tensor/tensor.h"

namespace tandem {

class Node;

using GradHook = std::function<Tensor(const Tensor&)>;

// What a layer above autograd records about a leaf (parallel/ records how a
// parameter is split over a mesh: Note [Parameter placements] in
// parallel/param_placement.h). Opaque here; Module::to keeps it when it moves
// a parameter.
struct LeafAnnotation {
  virtual ~LeafAnnotation() = default;
};

struct AutogradMeta final : AutogradMetaBase {
  bool requires_grad = false;
  Tensor grad;                                       // leaves (and retain_grad tensors)
  std::shared_ptr<Node> grad_fn;                     // null for leaves
  int output_nr = 0;                                 // which output of grad_fn this tensor is
  std::vector<std::pair<int, GradHook>> leaf_hooks;  // (handle id, hook)
  std::string name;                                  // optional, for messages
  std::shared_ptr<const LeafAnnotation> annotation;  // leaves only
  std::mutex mu;                                     // guards grad against concurrent readers
};

struct Edge {
  std::shared_ptr<Node> fn;            // producing node, or
  std::shared_ptr<AutogradMeta> leaf;  // a leaf that requires grad
  int output_nr = 0;
  bool valid() const { return fn != nullptr || leaf != nullptr; }
};

class Node {
 public:
  Node();
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  virtual const char* name() const = 0;
  // grads[i]: gradient of output i (undefined when none arrived). Returns one
  // gradient per input edge (undefined = none).
  virtual std::vector<Tensor> apply(std::vector<Tensor>& grads) = 0;
  // Drops saved tensors after a replay without retain_graph.
  virtual void release_saved() {}

  uint64_t sequence_nr() const { return sequence_nr_; }
  const std::vector<Edge>& next_edges() const { return next_; }
  int num_outputs() const { return num_outputs_; }
  // Whether input i needs a gradient (skip computing it otherwise).
  bool needs_grad(size_t i) const { return i < next_.size() && next_[i].valid(); }

  // Hooks on output slots (tensor hooks of non-leaf tensors).
  int add_output_hook(int output_nr, GradHook hook);
  bool remove_output_hook(int handle);
  const std::vector<std::pair<int, std::pair<int, GradHook>>>& output_hooks() const {
    return output_hooks_;
  }
  bool released() const { return released_; }
  void mark_released() { released_ = true; }

 private:
  friend struct NodeRecorder;
  uint64_t sequence_nr_;
  int num_outputs_ = 0;
  bool released_ = false;
  std::vector<Edge> next_;
  std::vector<std::pair<int, std::pair<int, GradHook>>> output_hooks_;  // (handle, (slot, hook))
};

// ---- grad mode ----
bool grad_mode_enabled();
void set_grad_mode(bool enabled);

class NoGradGuard {
 public:
  NoGradGuard() : previous_(grad_mode_enabled()) { set_grad_mode(false); }
  ~NoGradGuard() { set_grad_mode(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

class EnableGradGuard {
 public:
  EnableGradGuard() : previous_(grad_mode_enabled()) { set_grad_mode(true); }
  ~EnableGradGuard() { set_grad_mode(previous_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

// ---- tensor-level autograd accessors ----
AutogradMeta* autograd_meta(const Tensor& t);  // null when the tensor has none
bool requires_grad(const Tensor& t);
// Marks a leaf as requiring grad (returns the same handle for chaining).
Tensor& set_requires_grad(Tensor& t, bool value = true);
Tensor requires_grad_(Tensor t, bool value = true);
bool is_leaf(const Tensor& t);
Tensor grad(const Tensor& t);  // undefined when none
void set_grad(const Tensor& t, const Tensor& g);
void zero_grad(const Tensor& t);  // drops the gradient
// The LeafAnnotation of a leaf (null when none was set).
std::shared_ptr<const LeafAnnotation> leaf_annotation(const Tensor& t);
// Sets it on a leaf that requires grad (a parameter); every handle of that
// leaf sees it.
void set_leaf_annotation(const Tensor& t, std::shared_ptr<const LeafAnnotation> annotation);
std::shared_ptr<Node> grad_fn(const Tensor& t);
// The same data without autograd history.
Tensor detach(const Tensor& t);
// Registers a hook called with the tensor's gradient when it is complete; its
// result (if defined) replaces the gradient. Returns a handle for removal.
int register_hook(const Tensor& t, GradHook hook);
void remove_hook(const Tensor& t, int handle);
// Keeps the gradient of a non-leaf tensor in grad(t) after backward.
void retain_grad(const Tensor& t);

// ---- recording (for op implementations and Function) ----
// True when an op with these inputs must record a node.
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);
bool any_requires_grad(const std::vector<Tensor>& inputs);

struct NodeRecorder {
  // Wires `node` to its inputs and outputs (outputs get AutogradMeta pointing
  // at the node). Call only when any_requires_grad(inputs) under grad mode.
  static void wire(const std::shared_ptr<Node>& node, const std::vector<const Tensor*>& inputs,
                   const std::vector<Tensor*>& outputs);
};

// Creates node type N wired to inputs/outputs if recording is needed; returns
// null otherwise. The caller then fills N's saved tensors.
template <class N>
std::shared_ptr<N> record(std::initializer_list<const Tensor*> inputs,
                          std::initializer_list<Tensor*> outputs) {
  if (!grad_mode_enabled() || !any_requires_grad(inputs)) return nullptr;
  auto node = std::make_shared<N>();
  NodeRecorder::wire(node, std::vector<const Tensor*>(inputs), std::vector<Tensor*>(outputs));
  return node;
}

}  // namespace tandem
