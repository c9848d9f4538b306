#pragma once

// The node this thread is running for a torch_ext call, while its apply()
// runs: where a collective's backward formula may hand its in-flight result
// to the engine (BackwardCall::defer_wait_to_first_use, deferred_waits.cpp).
// The executor (node_executor.cpp) sets it around every node it runs.

#include "engine/backward_call.h"

namespace torch_ext {

struct RunningNode {
  BackwardCall* call;
  Node* node;
};

// The innermost node running on this thread, or null. Out of line: only the
// rare readers (a collective's formula) pay a call; the executor sets it
// through RunningNodeScope, inlined in its own file.
const RunningNode* running_node_now();

} // namespace torch_ext
