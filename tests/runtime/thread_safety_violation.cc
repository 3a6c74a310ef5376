// Not built: tools/scripts/test.sh's clang pass compiles this file with -Wthread-safety
// -Werror=thread-safety and requires the compile to FAIL, so the pass is shown to catch a member
// read without the lock that guards it, a call that needs a lock nobody holds, and a wait
// without the waiter's lock. If this file ever compiles under that pass, the annotations
// (runtime/base/thread_annotations.h) have stopped checking anything.
#include "runtime/base/mutex.h"

namespace strata {

class Counter {
 public:
  int Read() const { return n_; }  // violation: n_ read without mu_
  void Bump() { BumpLocked(); }    // violation: BumpLocked requires mu_
  void Await() { cv_.Wait(&mu_); }  // violation: waits without holding mu_

 private:
  void BumpLocked() REQUIRES(mu_) { ++n_; }
  mutable Mutex mu_;
  CondVar cv_;
  int n_ GUARDED_BY(mu_) = 0;
};

int Use() {
  Counter c;
  c.Bump();
  c.Await();
  return c.Read();
}

}  // namespace strata
