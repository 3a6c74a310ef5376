// DelayingDevice: a test-only wrapper that makes every stream's work late. Before each copy,
// fill, host callback or kernel enqueued on one of its streams it enqueues a sleep of a random 0 to
// `max_delay_us` microseconds on the same stream, so work completes in the same order but much
// later than the caller enqueued it. Code that reads a stream's results without waiting for the
// stream (or an event recorded after the work) then reads them too early, and the results
// differ: the suites that pass under it have no missing wait. (PyTorch's FSDP tests do the same
// with GPU sleeps on the compute stream.) Fresh allocations are filled with 0xFF bytes (NaN as
// floats), so memory read before its copy landed cannot pass for the values a previous
// allocation left there.
#pragma once

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "runtime/base/device.h"

namespace strata::testing {

class DelayingDevice final : public Device {
 public:
  DelayingDevice(std::unique_ptr<Device> inner, int max_delay_us, uint32_t seed = 1)
      : inner_(std::move(inner)), max_delay_us_(max_delay_us), rng_(seed) {}

  DeviceKind kind() const override { return inner_->kind(); }
  int index() const override { return inner_->index(); }
  std::string name() const override { return inner_->name() + " (delaying)"; }
  uint64_t capacity() const override { return inner_->capacity(); }
  uint64_t allocated() const override { return inner_->allocated(); }
  uint64_t peak_allocated() const override { return inner_->peak_allocated(); }
  StatusOr<void*> Allocate(size_t bytes) override {
    STRATA_ASSIGN_OR_RETURN(void* p, inner_->Allocate(bytes));
    if (inner_->kind() == DeviceKind::kCpu) std::memset(inner_->ComputeAddress(p), 0xFF, bytes);
    return p;
  }
  Status Free(void* ptr) override { return inner_->Free(ptr); }
  void* ComputeAddress(void* ptr) const override { return inner_->ComputeAddress(ptr); }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_->CreateEvent(); }
  Status Synchronize() override { return inner_->Synchronize(); }
  Status OrderForeignStream(void* native_stream, Event& event) override {
    return inner_->OrderForeignStream(native_stream, event);
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) override {
    STRATA_ASSIGN_OR_RETURN(auto s, inner_->CreateStream(priority));
    return std::unique_ptr<Stream>(new DelayingStream(std::move(s), this));
  }

  int delays() const {
    std::lock_guard<std::mutex> l(mu_);
    return delays_;
  }

 private:
  class DelayingStream final : public Stream {
   public:
    DelayingStream(std::unique_ptr<Stream> inner, DelayingDevice* dev)
        : inner_(std::move(inner)), dev_(dev) {}
    Status MemcpyAsync(void* dst, const void* src, size_t bytes, CopyKind kind) override {
      STRATA_RETURN_IF_ERROR(Delay());
      return inner_->MemcpyAsync(dst, src, bytes, kind);
    }
    Status MemsetAsync(void* dst, int value, size_t bytes) override {
      STRATA_RETURN_IF_ERROR(Delay());
      return inner_->MemsetAsync(dst, value, bytes);
    }
    Status LaunchHostFunc(std::function<void()> fn) override {
      STRATA_RETURN_IF_ERROR(Delay());
      return inner_->LaunchHostFunc(std::move(fn));
    }
    Status LaunchKernel(std::function<Status(void*)> kernel) override {
      STRATA_RETURN_IF_ERROR(Delay());
      return inner_->LaunchKernel(std::move(kernel));
    }
    Status Record(Event& e) override { return inner_->Record(e); }
    Status Wait(Event& e) override { return inner_->Wait(e); }
    Status Synchronize() override { return inner_->Synchronize(); }
    bool Query() override { return inner_->Query(); }

   private:
    Status Delay() {
      const int us = dev_->NextDelay();
      return inner_->LaunchHostFunc(
          [us] { std::this_thread::sleep_for(std::chrono::microseconds(us)); });
    }
    std::unique_ptr<Stream> inner_;
    DelayingDevice* dev_;
  };

  int NextDelay() {
    std::lock_guard<std::mutex> l(mu_);
    ++delays_;
    return std::uniform_int_distribution<int>(0, max_delay_us_)(rng_);
  }

  std::unique_ptr<Device> inner_;
  const int max_delay_us_;
  mutable std::mutex mu_;
  std::mt19937 rng_;  // GUARDED_BY(mu_)
  int delays_ = 0;    // GUARDED_BY(mu_)
};

}  // namespace strata::testing
