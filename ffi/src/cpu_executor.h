// CPU executor for jax_blink schedules: walks the execution plan over each rank's buffers.
#pragma once

#include <memory>

#include "blink_core.h"

namespace jax_blink {

// Runs the meeting's plan over the arrivals' buffers on the calling thread plus a small worker pool,
// then calls meeting->Finish(""). Never blocks waiting for other threads: the thread that completes the
// last tile finishes the meeting.
void ExecuteOnCpu(std::shared_ptr<Meeting> meeting);

}  // namespace jax_blink
