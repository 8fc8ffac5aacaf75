// TANDEM_NODE_NAME(N) inside a Node subclass of autograd/functions/: its
// name() (Node::name, autograd/node.h), "N", as backward traces and error
// messages show it.
#pragma once

#define TANDEM_NODE_NAME(N)           \
  const char* name() const override { \
    return #N;                        \
  }
