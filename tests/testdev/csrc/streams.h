// Streams and events of the testdev device: each stream is a worker thread
// that runs its work items in order, later than they were issued, so a
// missing stream wait in code under test reads or writes memory at the wrong
// time, as on a GPU.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>

namespace testdev {

constexpr c10::DeviceIndex kDeviceCount = 2;
// Stream id 0 is a device's default stream; ids 1..kPoolSize are its pool.
constexpr int kPoolSize = 32;

// Runs `work` on `stream`'s worker thread, after everything enqueued on that
// stream before it. The worker never takes the GIL. An exception thrown by
// `work` is kept and rethrown by the next synchronize of that stream.
void enqueue(c10::Stream stream, std::function<void()> work);

// The calling thread's current device (0 until set).
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex device);
void check_device(c10::DeviceIndex device);

c10::Stream default_stream(c10::DeviceIndex device);
// The calling thread's current stream of `device` (-1: the current device).
c10::Stream current_stream(c10::DeviceIndex device = -1);
// Makes `stream` current for its device on this thread; returns the previous.
c10::Stream exchange_stream(c10::Stream stream);
// The next pool stream of `device`, round robin.
c10::Stream stream_from_pool(c10::DeviceIndex device);

// Host waits for all work enqueued on the stream so far.
void synchronize_stream(c10::Stream stream);
bool query_stream(c10::Stream stream);
// Host waits for all work enqueued so far on every stream of the device
// (-1: every device).
void synchronize_device(c10::DeviceIndex device);
// Enqueues a sleep of `ms` milliseconds on the stream (like torch.cuda._sleep).
void hold(c10::Stream stream, double ms);

// Events follow CUDA's rule: record enqueues a marker on the stream (a new
// version of the event); block enqueues on the waiting stream a wait for the
// marker of the last record made before the block call.
void* event_create(bool enable_timing);
void event_destroy(void* event);
void event_record(void* event, c10::Stream stream);
void event_block(void* event, c10::Stream stream);
// True when never recorded or when its last marker has run.
bool event_query(void* event);
void event_synchronize(void* event);
// Milliseconds between the two events' markers; both must have run.
double event_elapsed_ms(void* start, void* end);

// Orders `waiter` after all work enqueued on `waitee` so far (a one-off event).
void stream_wait_stream(c10::Stream waiter, c10::Stream waitee);

} // namespace testdev
