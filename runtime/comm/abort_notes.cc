// The store's side of a rank giving up (Note [giving up] in communicator.cc): one key per rank.
#include <string>

#include "runtime/comm/backends.h"

namespace strata {

namespace {
std::string AbortKey(int rank) { return StrCat("strata/abort/", rank); }
}  // namespace

void PublishAbortNote(RendezvousStore& store, int rank, const std::string& note) {
  if (note.empty() || !store.Set(AbortKey(rank), note).ok()) return;
  (void)store.Has(AbortKey(rank));  // the round trip: the note has landed once it returns
}

std::string ReadAbortNotes(RendezvousStore& store, int rank, int world_size) {
  std::string notes;
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) continue;
    const StatusOr<bool> has = store.Has(AbortKey(r));
    if (!has.ok()) return notes;  // the store went with its rank: nothing more to learn
    if (!*has) continue;
    const StatusOr<std::string> note = store.Get(AbortKey(r));
    if (note.ok()) notes += StrCat(notes.empty() ? "" : "; ", *note);
  }
  return notes;
}

}  // namespace strata
