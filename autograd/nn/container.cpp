#include "tandem/autograd/nn/container.h"

#include "tandem/runtime/error.h"

namespace tandem::nn {

const std::shared_ptr<Module>& ModuleList::operator[](size_t i) const {
  TANDEM_CHECK(i < items_.size(), "[nn::ModuleList] expected an index below {}, got {}",
               items_.size(), i);
  return items_[i];
}

std::vector<Tensor> ModuleList::forward(Args&) {
  TANDEM_FAIL("[nn::ModuleList] expected a call on one of its {} modules, got a call on the list",
              items_.size());
}

const Tensor& single_input(Args& args, const char* module) {
  TANDEM_CHECK(!args.positional.empty() && args.positional[0].defined(),
               "[nn::{}] expected one positional input tensor, got {} positional", module,
               args.positional.size());
  return args.positional[0];
}

}  // namespace tandem::nn
