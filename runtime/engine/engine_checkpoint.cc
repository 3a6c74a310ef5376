// Checkpoints of the engine (layout and publication rules: runtime/state/checkpoint.h).
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <map>

#include "runtime/base/remove_tree.h"
#include "runtime/engine/engine_impl.h"
#include "runtime/state/saved_state_reader.h"

namespace strata {

using namespace engine_detail;

namespace {
// SaveCheckpoint's client file: beside the rank's manifest, described in its "extra".
constexpr const char* kClientFileSuffix = ".client.bin";
constexpr const char* kClientFileKey = "strata_client_file";

// Note [one save into a root at a time]
// Two runs saving into one root removed each other's temporary folders, and the one that lost
// failed with ENOENT on a file it had just made. Rank 0 holds an exclusive flock on the root's
// .strata-save.lock for the whole save; a second run is refused at once, naming the root. The
// file stays (removing a locked file would let a third process lock a new one beside it).
class SaveRootLock {
 public:
  SaveRootLock() = default;
  SaveRootLock(const SaveRootLock&) = delete;
  SaveRootLock& operator=(const SaveRootLock&) = delete;
  ~SaveRootLock() {
    if (fd_ >= 0) close(fd_);
  }
  Status Take(const std::string& root) {
    std::error_code ec;
    std::filesystem::create_directories(root, ec);
    if (ec) return ErrnoToStatus(ec.value(), StrCat("create checkpoint directory ", root));
    const std::string path = (std::filesystem::path(root) / ".strata-save.lock").string();
    fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) return ErrnoToStatus(errno, StrCat("open ", path));
    if (flock(fd_, LOCK_EX | LOCK_NB) == 0) return Status::Ok();
    const int err = errno;
    if (err == EWOULDBLOCK)
      return FailedPrecondition(StrCat("another process is saving into ", root, " (it holds ", path,
                                       "); give each run its own save folder"));
    return ErrnoToStatus(err, StrCat("lock ", path));
  }

 private:
  int fd_ = -1;
};
}  // namespace

// ---------------------------------------------------------------------------------------------
// Checkpoints (layout and publication rules: runtime/state/checkpoint.h).

namespace {

constexpr StateKind kSavedKinds[] = {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq};

StatusOr<StateKind> KindFromName(const std::string& name) {
  for (StateKind k : kSavedKinds)
    if (name == StateKindName(k)) return k;
  return DataLoss(StrCat("unknown state '", name, "' in checkpoint manifest"));
}

Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, StrCat("write ", path));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

// Whose states exp_avg and exp_avg_sq hold (checkpoint::Manifest::optimizer): Adam and AdamW
// keep the same two moments.
const char* OptimizerStates(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: return "adam";
    case OptimizerType::kSGD: return "sgd";
    case OptimizerType::kAdagrad: return "adagrad";
    case OptimizerType::kLion: return "lion";
  }
  return "";
}

// Every rank's own check of the save root (`own`, CheckSaveRoot) and the root each names, agreed
// in one all-reduce before rank 0 prepares it: a rank that refused it, or a root that differs by
// rank (each rank's files would go to its own folder, and rank 0 would publish a checkpoint
// holding its own alone), fails the save on every rank. The roots are compared as given, up to
// redundant separators and dots; the same relative root from another working directory is not
// told apart.
Status AgreeOnSaveRoot(Communicator& comm, Device& device, const std::string& root, Status own) {
  if (comm.world_size() == 1) return own;
  std::string normal = std::filesystem::path(root).lexically_normal().string();
  while (normal.size() > 1 && normal.back() == '/') normal.pop_back();
  const double crc = nvme::Crc32c(normal.data(), normal.size());
  double values[3] = {own.ok() ? 0.0 : comm.rank() + 1.0, crc, -crc};
  Status agreed = AllReduceScalars(comm, device, values, 3, ReduceOp::kMax);
  if (!own.ok()) return own;
  STRATA_RETURN_IF_ERROR(agreed);
  if (values[0] > 0)
    return FailedPrecondition(StrCat("saving checkpoint into ", root, ": rank ",
                                     static_cast<int>(values[0]) - 1,
                                     " refused its save folder; its log says why"));
  if (values[1] != -values[2])
    return InvalidArgument(StrCat(
        "saving checkpoint into ", root, ": the ranks name different save folders (rank ",
        comm.rank(),
        " names this one); every rank saves into one folder, so give them all the "
        "same path (a path made from the rank would leave a part of the checkpoint in each)"));
  return Status::Ok();
}

// "[6, 4]", as PyTorch prints a size.
std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += StrCat(i ? ", " : "", shape[i]);
  return out + "]";
}

}  // namespace

Status Engine::Impl::Save(const std::string& root, const nlohmann::json& extra,
                          const std::string& client_file, bool with_frozen) {
  namespace fs = std::filesystem;
  STRATA_RETURN_IF_ERROR(CheckNoBackwardSinceStep("SaveCheckpoint"));
  STRATA_RETURN_IF_ERROR(CheckStateWhole("SaveCheckpoint"));
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  const std::string name = checkpoint::StepDirName(step_.global_step);
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = fs::path(root) / ("." + name + ".tmp");
  // Every check a rank makes on its own is in the first agreement, so that a rank refusing the
  // root leaves none of the others waiting for it.
  Status prepared = AgreeOnSaveRoot(*comm_, *device_, root, checkpoint::CheckSaveRoot(root));
  SaveRootLock lock;
  bool made = false;
  if (prepared.ok() && comm_->rank() == 0) {
    prepared = lock.Take(root);
    if (prepared.ok()) prepared = PrepareSaveDir(root, name);
    made = prepared.ok();
  }
  // None writes into the folder before rank 0 has made it afresh.
  prepared = AgreeOnSave(std::move(prepared), final_dir.string(), "prepare it");
  if (!prepared.ok() && made) RemoveTree(tmp_dir.string()).IgnoreError();
  STRATA_RETURN_IF_ERROR(prepared);
  if (hooks_.crash_point) hooks_.crash_point("checkpoint:before_write");

  checkpoint::Manifest m = NewManifest(extra);
  const std::string stem = checkpoint::RankFileStem(comm_->rank());
  uint64_t bytes = 0;
  Status s;
  {
    std::error_code ec;
    fs::create_directories(tmp_dir, ec);
    if (ec) s = ErrnoToStatus(ec.value(), StrCat("create ", tmp_dir.string()));
  }
  if (s.ok()) s = WriteStateFile((tmp_dir / (stem + ".bin")).string(), &m, with_frozen, &bytes);
  if (s.ok() && !client_file.empty()) {
    // The caller's own per-rank state, published with the rest; its size and crc32c in the
    // manifest let ReadClientFile refuse a damaged one.
    s = checkpoint::WriteFileAtomic((tmp_dir / (stem + kClientFileSuffix)).string(), client_file);
    m.extra[kClientFileKey] = {{"bytes", client_file.size()},
                               {"crc32c", nvme::Crc32c(client_file.data(), client_file.size())}};
  }
  if (s.ok())
    s = checkpoint::WriteFileAtomic((tmp_dir / (stem + ".json")).string(),
                                    checkpoint::SerializeManifest(m));
  if (!s.ok()) s = s.WithContext(StrCat("saving checkpoint ", final_dir.string()));
  s = AgreeOnSave(std::move(s), final_dir.string(), "write its files");
  // Every rank is done with the folder; an unfinished one goes now rather than with the next
  // save, since a full disk is the likeliest reason.
  if (!s.ok() && comm_->rank() == 0) RemoveTree(tmp_dir.string()).IgnoreError();
  STRATA_RETURN_IF_ERROR(s);
  STRATA_RETURN_IF_ERROR(PublishSave(root, name));
  STRATA_LOG(INFO) << "checkpoint saved dir=" << final_dir.string() << " bytes=" << bytes;
  return Status::Ok();
}

// Note [saving over a step]
// A save of a step the root already holds writes the whole checkpoint again and replaces the old
// one, as DeepSpeed's save into a tag does. Skipping it, as saves once did when the step's
// manifest existed, kept another run's weights under this run's name (a fresh run into an old
// root, a fork resumed from an earlier step), and on several ranks each rank decided from its
// own files, so one skipped while another waited at the barrier. The replacement is one atomic
// exchange of the two directories (renameat2 RENAME_EXCHANGE), so a crash leaves either whole
// checkpoint under the name; where the file system lacks it (NFS), two renames, with the old
// copy under a hidden name (.step-N.old) for that instant. A crash there leaves the step
// missing, so a load that `latest` sends there reads the hidden copy (ResolveCheckpointDir) and
// the next save gives it its name back. Rank 0 alone prepares, holding the root's lock (Note
// [one save into a root at a time]).
Status Engine::Impl::PrepareSaveDir(const std::string& root, const std::string& name) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path tmp_dir = fs::path(root) / ("." + name + ".tmp");
  // Leftovers of saves that crashed, this step's own included: a stale one could hold the files
  // of ranks this world does not have.
  std::vector<fs::path> leftovers;
  for (const auto& e : fs::directory_iterator(root, ec)) leftovers.push_back(e.path());
  for (const fs::path& p : leftovers) {
    const std::string n = p.filename().string();
    if (n.size() <= 5 || n[0] != '.') continue;
    if (n.rfind(".step-", 0) == 0 && n.rfind(".old") == n.size() - 4) {
      // .<step>.old of a replacement cut short (ReplaceDir's fallback): where <step> is
      // missing, it is that step's only copy, which `latest` may name, so it takes its name
      // back; otherwise the replacement finished and it goes.
      const fs::path step = fs::path(root) / n.substr(1, n.size() - 5);
      if (!fs::exists(step, ec)) {
        fs::rename(p, step, ec);
        if (ec)
          return ErrnoToStatus(ec.value(), StrCat("restore ", step.string(), " from ", p.string()));
        STRATA_LOG(WARN) << "restored " << step.string()
                         << " from the copy a save cut short had moved aside";
      } else {
        RemoveTree(p.string()).IgnoreError();  // harmless if it stays
      }
    } else if (n.rfind(".tmp") == n.size() - 4 && p != tmp_dir) {
      RemoveTree(p.string()).IgnoreError();  // .<name>.tmp of any save; harmless if it stays
    }
  }
  if (fs::exists(tmp_dir, ec))
    STRATA_RETURN_IF_ERROR(
        RemoveTree(tmp_dir.string()).WithContext("an earlier save's leftover of this step"));
  fs::create_directories(tmp_dir, ec);
  if (ec) return ErrnoToStatus(ec.value(), StrCat("create ", tmp_dir.string()));
  return Status::Ok();
}

checkpoint::Manifest Engine::Impl::NewManifest(const nlohmann::json& extra) const {
  checkpoint::Manifest m;
  m.rank = comm_->rank();
  m.world_size = comm_->world_size();
  m.stage = config_.zero_optimization.stage;
  m.dtype = optim::DTypeName(plan_.compute_dtype());
  m.state_dtype = plan_.StateLayoutName();
  m.optimizer = OptimizerStates(config_.optimizer.type);
  m.parameters = num_params();
  for (const ChunkInfo& ci : partitioner_->chunks()) m.shard_numel.push_back(ci.shard_numel);
  m.global_step = step_.global_step;
  m.micro_step = step_.micro_step;
  m.optimizer_steps = step_.global_step - step_.moments_from;
  m.gradient_accumulation_steps = config_.gradient_accumulation_steps;
  if (step_.scaler) {
    const optim::DynamicLossScaler::State st = step_.scaler->state();
    m.scaler = {{"scale", st.scale},
                {"hysteresis_left", st.hysteresis_left},
                {"iteration", st.iteration},
                {"last_overflow_iteration", st.last_overflow_iteration}};
  }
  m.extra = extra;
  m.layout = LayoutJson();
  return m;
}

Status Engine::Impl::WriteStateFile(const std::string& bin, checkpoint::Manifest* m,
                                    bool with_frozen, uint64_t* bytes_written) {
  // Stream every block from wherever it lives straight into the file: no state is staged whole.
  int fd = ::open(bin.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("create ", bin));
  Status s;
  uint64_t offset = 0;
  std::vector<char> staging;
  for (size_t c = 0; c < chunks_.size() && s.ok(); ++c) {
    for (StateKind kind : kSavedKinds) {
      if (!plan_.HoldsState(kind)) continue;  // Note [states the optimizer uses]
      const int64_t c64 = static_cast<int64_t>(c);
      const uint64_t bytes = SavedBytes(c64, kind);
      const BlockKey key = kind == StateKind::kMaster32 ? plan_.MasterKey(c64) : BlockKey{c64, kind};
      auto data = store_->Acquire(key, Access::kRead);
      if (!data.ok()) {
        s = data.status();
        break;
      }
      // A device block reaches the file through a host copy (Note [device blocks]).
      const void* bytes_at = *data;
      if (plan_.PlacementOf(c64, key.kind) == Placement::kDevice) {
        staging.resize(bytes);
        s = ReadBlockBytes(staging.data(), *data, bytes, Placement::kDevice);
        bytes_at = staging.data();
      }
      if (s.ok()) s = WriteAll(fd, bytes_at, bytes, bin);
      uint32_t crc = nvme::Crc32c(bytes_at, bytes);
      Status r = store_->Release(key, false);
      if (s.ok()) s = r;
      if (!s.ok()) break;
      m->blocks.push_back({c64, StateKindName(kind), offset, bytes, crc});
      offset += bytes;
    }
  }
  // Buffers after the blocks, then (rank 0) the frozen parameters, each from a host copy.
  const bool frozen_here = with_frozen && comm_->rank() == 0;
  for (const auto& [tensors, entries] : {std::pair{&buffers_, &m->buffers},
                                         std::pair{frozen_here ? &frozen_ : nullptr, &m->frozen}}) {
    if (tensors == nullptr) continue;
    for (size_t i = 0; i < tensors->size() && s.ok(); ++i) {
      const auto& [name, b] = (*tensors)[i];
      torch::Tensor host = b.detach().to(torch::kCPU).contiguous();
      const uint64_t bytes = host.nbytes();
      s = WriteAll(fd, host.data_ptr(), bytes, bin);
      entries->push_back({name, std::string(c10::toString(host.scalar_type())), offset, bytes,
                          nvme::Crc32c(host.data_ptr(), bytes)});
      offset += bytes;
    }
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoToStatus(errno, StrCat("fsync ", bin));
  ::close(fd);
  *bytes_written = offset;
  return s;
}

namespace {

// Makes the finished folder `from` appear as `to` (Note [saving over a step]); an older `to` is
// removed once the new one stands in its place.
Status ReplaceDir(const std::filesystem::path& from, const std::filesystem::path& to) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(to, ec)) {
    fs::rename(from, to, ec);
    if (ec) return ErrnoToStatus(ec.value(), StrCat("rename ", from.string(), " to ", to.string()));
    return Status::Ok();
  }
  fs::path old = from;  // after the exchange, the older checkpoint
  if (renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0) {
    const int err = errno;
    if (err != EINVAL && err != ENOSYS)
      return ErrnoToStatus(err, StrCat("exchange ", from.string(), " with ", to.string()));
    old = to.parent_path() / ("." + to.filename().string() + ".old");
    fs::rename(to, old, ec);
    if (!ec) fs::rename(from, to, ec);
    if (ec)
      return ErrnoToStatus(ec.value(), StrCat("replace ", to.string(), " by ", from.string()));
  }
  // The new checkpoint is in place; an old copy left by a crash here goes with the next save.
  RemoveTree(old.string()).IgnoreError();
  return Status::Ok();
}

}  // namespace

Status Engine::Impl::PublishSave(const std::string& root, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = fs::path(root) / ("." + name + ".tmp");
  // A crash point (EngineTestHooks): every file written, nothing published.
  if (hooks_.crash_point) hooks_.crash_point("checkpoint:before_publish");
  Status published;
  if (comm_->rank() == 0) {
    // `latest`'s new bytes are on disk before the step is published, so that a full disk
    // refuses the save with the root as it was, not after the step stands unnamed (a first
    // save would then leave a root that --resume calls empty). PrepareSaveDir removes a
    // leftover.
    const std::string latest_tmp = (fs::path(root) / ".latest.tmp").string();
    published = checkpoint::FsyncDir(tmp_dir.string());
    if (published.ok()) published = checkpoint::WriteNewFile(latest_tmp, name);
    if (published.ok()) {
      published = ReplaceDir(tmp_dir, final_dir);
      if (published.ok()) published = checkpoint::FsyncDir(root);
      if (published.ok())
        published = checkpoint::PublishFile(latest_tmp, (fs::path(root) / "latest").string());
      else
        ::unlink(latest_tmp.c_str());
    }
    if (!published.ok()) {
      published = published.WithContext(StrCat("saving checkpoint ", final_dir.string()));
      RemoveTree(tmp_dir.string()).IgnoreError();  // gone already once ReplaceDir succeeded
    }
  }
  return AgreeOnSave(std::move(published), final_dir.string(), "publish it");
}

Status Engine::Impl::AgreeOnSave(Status own, const std::string& dir, const char* what) {
  if (comm_->world_size() == 1) return own;
  double failed = own.ok() ? 0.0 : comm_->rank() + 1.0;
  Status agreed = AllReduceScalars(*comm_, *device_, &failed, 1, ReduceOp::kMax);
  if (!own.ok()) return own;
  STRATA_RETURN_IF_ERROR(agreed);
  if (failed > 0)
    return FailedPrecondition(StrCat("saving checkpoint ", dir, ": rank ",
                                     static_cast<int>(failed) - 1, " could not ", what,
                                     "; its log says why"));
  return Status::Ok();
}

uint64_t Engine::Impl::SavedBytes(int64_t c, StateKind kind) const {
  return plan_.BlockBytes(kind, partitioner_->chunks()[c].shard_numel);
}

nlohmann::json Engine::Impl::LayoutJson() const {
  nlohmann::json shard_offset = nlohmann::json::array(), chunk_numel = nlohmann::json::array();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    shard_offset.push_back(partitioner_->ShardOffset(static_cast<int64_t>(c), plan_.shard_rank()));
    chunk_numel.push_back(partitioner_->chunks()[c].numel);
  }
  nlohmann::json params = nlohmann::json::array();
  for (size_t pid = 0; pid < params_.size(); ++pid) {
    const ParamLocation& loc = partitioner_->location(static_cast<int64_t>(pid));
    params.push_back({{"name", partitioner_->param_name(static_cast<int64_t>(pid))},
                      {"shape", params_[pid].shape},
                      {"chunk", loc.chunk},
                      {"offset", loc.offset}});
  }
  nlohmann::json buffers = nlohmann::json::array(), frozen = nlohmann::json::array();
  for (const auto& [name, b] : buffers_) buffers.push_back({{"name", name}, {"shape", b.sizes().vec()}});
  for (const auto& [name, p] : frozen_)
    frozen.push_back({{"name", name}, {"shape", p.sizes().vec()}});
  return {{"shard_offset", shard_offset},
          {"chunk_numel", chunk_numel},
          {"params", params},
          {"buffers", buffers},
          {"frozen", frozen}};
}

StatusOr<std::string> Engine::Impl::ReadClientFile(const std::string& path) {
  namespace fs = std::filesystem;
  STRATA_ASSIGN_OR_RETURN(std::string dir, checkpoint::ResolveCheckpointDir(path));
  const std::string stem = checkpoint::RankFileStem(comm_->rank());
  const std::string mpath = (fs::path(dir) / (stem + ".json")).string();
  STRATA_ASSIGN_OR_RETURN(std::string text, checkpoint::ReadFile(mpath));
  STRATA_ASSIGN_OR_RETURN(checkpoint::Manifest m, checkpoint::ParseManifest(text, mpath));
  if (!m.extra.is_object() || !m.extra.contains(kClientFileKey))
    return NotFound(StrCat(dir, " holds no client file for rank ", comm_->rank(),
                           " (it was saved without one)"));
  const std::string fpath = (fs::path(dir) / (stem + kClientFileSuffix)).string();
  STRATA_ASSIGN_OR_RETURN(std::string bytes, checkpoint::ReadFile(fpath));
  const auto& want = m.extra[kClientFileKey];
  if (bytes.size() != want.value("bytes", uint64_t{0}) ||
      nvme::Crc32c(bytes.data(), bytes.size()) != want.value("crc32c", uint32_t{0}))
    return DataLoss(StrCat(fpath, " does not match its manifest (size or crc32c): the checkpoint "
                           "is damaged; load an earlier one"));
  return bytes;
}

namespace {

// A buffer's or frozen parameter's saved bytes, checked, as a host tensor of `like`'s type and
// shape. A floating one takes the working precision (PlaceBuffers), so a run saved in another
// precision kept it in another floating type: read as saved, then converted. DATA_LOSS when the
// entry cannot hold this tensor.
StatusOr<torch::Tensor> ReadSavedTensor(int fd, const std::string& bin,
                                        const checkpoint::BufferEntry& e, const torch::Tensor& like,
                                        const std::string& what, const std::string& mpath) {
  const std::string type(c10::toString(like.scalar_type()));
  torch::ScalarType saved = like.scalar_type();
  if (e.dtype != type && like.is_floating_point())
    for (torch::ScalarType t :
         {torch::kFloat32, torch::kBFloat16, torch::kFloat16, torch::kFloat64})
      if (e.dtype == c10::toString(t)) saved = t;
  const uint64_t saved_bytes = static_cast<uint64_t>(like.numel()) * c10::elementSize(saved);
  if (e.bytes != saved_bytes || e.dtype != c10::toString(saved))
    return DataLoss(StrCat(mpath, ": ", what, " (", type, ", ", like.nbytes(), " bytes) is ",
                           e.dtype, " of ", e.bytes,
                           " bytes there; the checkpoint belongs to another model"));
  torch::Tensor host = torch::empty(like.sizes(), torch::TensorOptions().dtype(saved));
  STRATA_RETURN_IF_ERROR(
      checkpoint::ReadChecked(fd, bin, e.offset, e.bytes, e.crc32c, what, host.data_ptr()));
  return saved == like.scalar_type() ? host : host.to(like.scalar_type());
}

}  // namespace

// Note [frozen parameters in checkpoints]
// Parameters no unit trains are whole on every rank and change only by the script's hand, yet
// they are part of the model: a run resumed into a freshly built model needs them as saved (a
// frozen embedding, a base model under adapters), and zero_to_fp32's state_dict must hold them to
// load strictly. Rank 0 saves them once, after its buffers, each under its first name; every rank
// reads them from rank 0's file on load, matched under any of the parameter's names (a tied one
// may come first under another module now). Load checks every one's bytes before it overwrites
// any state (FrozenOnDisk::Read without apply), then reads them again into the parameters, so
// that memory holds one at a time. A checkpoint without some of them (saved with
// exclude_frozen_parameters, as Hugging Face's Trainer saves adapters; or before they were kept)
// leaves those as the model has them, and says so.
namespace {

struct FrozenOnDisk {
  std::string dir, bin, mpath;
  checkpoint::Manifest rank0;  // rank 0's manifest, which holds the frozen entries
  // Per frozen parameter (Engine::Impl::frozen_), its saved entry, or null.
  std::vector<const checkpoint::BufferEntry*> entry;
  std::vector<std::string> kept;  // the names of those without one

  // `m` is this rank's manifest; `module` the model, for every name of each frozen parameter.
  static StatusOr<std::unique_ptr<FrozenOnDisk>> Find(
      const std::string& dir, const checkpoint::Manifest& m, const torch::nn::Module& module,
      const std::vector<std::pair<std::string, torch::Tensor>>& frozen) {
    namespace fs = std::filesystem;
    auto f = std::make_unique<FrozenOnDisk>();
    f->dir = dir;
    f->mpath = (fs::path(dir) / (checkpoint::RankFileStem(0) + ".json")).string();
    f->bin = (fs::path(dir) / (checkpoint::RankFileStem(0) + ".bin")).string();
    if (m.rank == 0) {
      f->rank0 = m;
    } else {
      STRATA_ASSIGN_OR_RETURN(std::string text, checkpoint::ReadFile(f->mpath));
      STRATA_ASSIGN_OR_RETURN(f->rank0, checkpoint::ParseManifest(text, f->mpath));
    }
    std::map<std::string, const checkpoint::BufferEntry*> by_name;
    for (const auto& e : f->rank0.frozen) by_name[e.name] = &e;
    std::map<const c10::TensorImpl*, std::vector<std::string>> names;
    for (const auto& item : module.named_parameters(/*recurse=*/true))
      names[item.value().unsafeGetTensorImpl()].push_back(item.key());
    for (const auto& [first, p] : frozen) {
      const checkpoint::BufferEntry* found = nullptr;
      for (const std::string& n : names[p.unsafeGetTensorImpl()])
        if (auto it = by_name.find(n); it != by_name.end() && !found) found = it->second;
      f->entry.push_back(found);
      if (!found) f->kept.push_back(first);
    }
    return f;
  }

  // Reads each saved one, checked against its size, type and crc32c; `apply` copies it into the
  // parameter, else nothing is written.
  Status Read(const std::vector<std::pair<std::string, torch::Tensor>>& frozen, bool apply) const {
    if (kept.size() == frozen.size()) return Status::Ok();
    STRATA_ASSIGN_OR_RETURN(const int fd, checkpoint::OpenCheckpointFile(bin));
    Status s;
    for (size_t i = 0; i < frozen.size() && s.ok(); ++i) {
      if (!entry[i]) continue;
      const auto& [name, p] = frozen[i];
      auto value =
          ReadSavedTensor(fd, bin, *entry[i], p, StrCat("frozen parameter '", name, "'"), mpath);
      if (!value.ok()) {
        s = value.status();
      } else if (apply) {
        torch::NoGradGuard ng;
        p.copy_(*value);
      }
    }
    ::close(fd);
    return s;
  }

  // Read with apply, then a word on those that keep the model's values (rank 0 says it).
  Status Apply(const std::vector<std::pair<std::string, torch::Tensor>>& frozen, int rank) const {
    STRATA_RETURN_IF_ERROR(Read(frozen, /*apply=*/true));
    if (!kept.empty() && rank == 0)
      STRATA_LOG(INFO) << dir << " holds "
                       << (rank0.frozen.empty() ? "no frozen parameters"
                                                : "not every frozen parameter")
                       << " (saved with exclude_frozen_parameters, or another set was frozen): "
                       << kept.size() << " keep the model's values, '" << kept.front()
                       << "' the first";
    return Status::Ok();
  }
};

}  // namespace

// Note [a load cut short]
// A load checks the manifest, the buffers and the frozen parameters before it writes anything,
// then reads each block into scratch memory, checked against its crc32c, before it overwrites
// that block's state; a damaged block found after others were written (or a failing NVMe write)
// ends the load with the state part saved, part the run's own. Checking every block first would
// read the whole checkpoint twice. Instead the engine remembers the load, and refuses to train on
// the mixture or save it (a save would publish it as a checkpoint) until a load completes: the
// same checkpoint repaired, or an earlier one.
Status Engine::Impl::CheckStateWhole(const char* what) const {
  if (!step_.torn_by_load.empty())
    return FailedPrecondition(StrCat(
        what, " after a load of ", step_.torn_by_load,
        " failed part way, with some of the state overwritten from it: load a checkpoint whole "
        "first (that one repaired, or an earlier one)"));
  return CheckStatesResident(what);
}

StatusOr<nlohmann::json> Engine::Impl::Load(const std::string& path, Engine::LoadParts parts) {
  const bool weights_only = parts != Engine::LoadParts::kAll;
  namespace fs = std::filesystem;
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("LoadCheckpoint"));
  STRATA_RETURN_IF_ERROR(CheckStatesResident("LoadCheckpoint"));
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  STRATA_ASSIGN_OR_RETURN(std::string dir, checkpoint::ResolveCheckpointDir(path));
  // Note [a load cut short]: whatever returns from here on after a block was written leaves the
  // state torn; a load that completes makes it whole.
  step_.load_wrote = false;
  struct TornOnError {
    StepState& step;
    const std::string& dir;
    bool completed = false;
    ~TornOnError() {
      if (completed)
        step.torn_by_load.clear();
      else if (step.load_wrote)
        step.torn_by_load = dir;
    }
  } torn{step_, dir};
  // This rank's manifest; rank 0's where the saving run had fewer ranks (Note [elastic resume]).
  STRATA_ASSIGN_OR_RETURN(const std::string stem, checkpoint::LoadingStem(dir, comm_->rank()));
  const std::string mpath = (fs::path(dir) / (stem + ".json")).string();
  STRATA_ASSIGN_OR_RETURN(std::string text, checkpoint::ReadFile(mpath));
  STRATA_ASSIGN_OR_RETURN(checkpoint::Manifest m, checkpoint::ParseManifest(text, mpath));
  if (m.rank != comm_->rank() && comm_->rank() < m.world_size)
    return DataLoss(StrCat(dir, " was saved by ", m.world_size, " ranks but holds no ",
                           checkpoint::RankFileStem(comm_->rank()),
                           ".json: the checkpoint is incomplete; load an earlier one"));
  STRATA_RETURN_IF_ERROR(CheckManifestFits(m, dir));
  bool states_too = !weights_only;
  if (m.world_size != comm_->world_size() || m.stage != config_.zero_optimization.stage ||
      m.dtype != optim::DTypeName(plan_.compute_dtype()))
    STRATA_LOG(WARN)
        << dir << " was saved by " << m.world_size << " rank(s) at stage " << m.stage << " in "
        << m.dtype << "; loading it into " << comm_->world_size() << " rank(s) at stage "
        << config_.zero_optimization.stage << " in " << optim::DTypeName(plan_.compute_dtype())
        << ": every master and moment value as saved, the working copy rounded from the master"
        << " (Note [elastic resume])";
  // Note [another optimizer's states]: an SGD run would take an Adam run's exp_avg as its momentum
  // buffer (a tenth of its scale at momentum 0.9), Adagrad its exp_avg_sq as the running sum.
  // Another optimizer's states are left out, as DeepSpeed's torch optimizers leave state keys
  // they do not know; the weights and the counters load.
  const std::string ours = OptimizerStates(config_.optimizer.type);
  if (!weights_only && !m.optimizer.empty() && m.optimizer != ours) {
    STRATA_LOG(WARN) << dir << " holds " << m.optimizer << "'s optimizer states and this run's optimizer is "
                     << OptimizerTypeName(config_.optimizer.type)
                     << ", whose states mean something else: loading the weights and the step count; its "
                        "states start from zero";
    states_too = false;
  }
  // The same optimizer saved without a state this run keeps: SGD without momentum resumed with
  // momentum (torch's SGD under DeepSpeed starts the buffer then). Weights and counters load;
  // the states start from zero, as for another optimizer's.
  if (states_too) {
    for (StateKind kind : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      const bool saved = std::any_of(m.blocks.begin(), m.blocks.end(),
                                     [&](const auto& b) { return b.state == StateKindName(kind); });
      if (!plan_.HoldsState(kind) || saved || m.blocks.empty()) continue;
      STRATA_LOG(WARN) << dir << " holds no " << StateKindName(kind)
                       << " (its run's optimizer did not keep one: SGD without momentum, say) and "
                          "this run's does: loading the weights and the step count; its states "
                          "start from zero";
      states_too = false;
      break;
    }
  }
  // The loss scaler's state, read before any state is overwritten (a bad one loads nothing).
  std::optional<optim::DynamicLossScaler::State> scaler_state;
  if (step_.scaler && !weights_only) {
    STRATA_ASSIGN_OR_RETURN(scaler_state, SavedScalerState(m, mpath));
  }
  const std::string bin = (fs::path(dir) / (stem + ".bin")).string();
  STRATA_ASSIGN_OR_RETURN(const int fd, checkpoint::OpenCheckpointFile(bin));
  // Buffers first, all read and checked before any state is overwritten; the frozen parameters'
  // bytes checked too (Note [frozen parameters in checkpoints]).
  std::vector<torch::Tensor> buffer_values;
  std::unique_ptr<FrozenOnDisk> frozen_on_disk;
  Status s = ReadSavedBuffers(fd, bin, m, mpath, &buffer_values);
  if (s.ok() && !frozen_.empty()) {
    auto found = FrozenOnDisk::Find(dir, m, *model_.module, frozen_);
    if (found.ok()) frozen_on_disk = std::move(found).value();
    s = found.ok() ? frozen_on_disk->Read(frozen_, /*apply=*/false) : found.status();
  }
  if (s.ok())
    s = SameShards(m) ? ReadSavedBlocks(fd, bin, m, mpath, !states_too)
                      : ReadRelaidBlocks(dir, m, !states_too);
  ::close(fd);
  STRATA_RETURN_IF_ERROR(s);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < buffer_values.size(); ++i) buffers_[i].second.copy_(buffer_values[i]);
  }
  if (frozen_on_disk) STRATA_RETURN_IF_ERROR(frozen_on_disk->Apply(frozen_, comm_->rank()));
  // The working copy is the master rounded to the working precision, exactly what Adam writes.
  {
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const int64_t c64 = static_cast<int64_t>(c);
      if (plan_.MasterIsParam(c64)) continue;  // shared: already there
      std::vector<float> master(partitioner_->chunks()[c].shard_numel);
      STRATA_RETURN_IF_ERROR(ReadShard(c64, StateKind::kMaster32, master.data()));
      STRATA_RETURN_IF_ERROR(PublishMaster(c64, master));
    }
  }
  STRATA_RETURN_IF_ERROR(ShareUpdatedShards());
  STRATA_RETURN_IF_ERROR(materializer_->RefreshChunks());
  if (parts != Engine::LoadParts::kWeights) {
    // Note [the optimizer's own steps]
    // Adam's bias corrections (and Adagrad's lr decay) count the steps the optimizer's states
    // have taken, which is the global step until a load restores the counters without those
    // states (load_optimizer_states=False, or another optimizer's checkpoint): DeepSpeed's
    // optimizer then goes on with the states it has and their own count, here 0 in a fresh
    // engine. moments_from keeps the two apart; a checkpoint records the count where it differs.
    const int64_t own_steps = step_.global_step - step_.moments_from;
    const int64_t saved_steps = m.optimizer_steps >= 0 ? m.optimizer_steps : m.global_step;
    step_.global_step = m.global_step;
    step_.micro_step = ResumedMicroStep(m, mpath);
    step_.moments_from = m.global_step - (states_too ? saved_steps : own_steps);
    // Validated by SavedScalerState; a resumed fp16 run scales as the uninterrupted one would.
    if (scaler_state) STRATA_RETURN_IF_ERROR(step_.scaler->Restore(*scaler_state).WithContext(mpath));
  }
  torn.completed = true;
  STRATA_LOG(INFO) << "checkpoint loaded dir=" << dir << " step=" << m.global_step
                   << (parts == Engine::LoadParts::kWeights ? " (weights only)"
                       : weights_only                       ? " (weights and step counters)"
                                                            : "");
  return m.extra;
}

// Note [a saved loss scale]
// fp16's dynamic loss scale is training state: a run resumed at the initial 2^power skips steps
// to overflows until the scale comes down again, and doubles on another schedule, so the resumed
// run would not be the uninterrupted one. Checkpoints keep the scaler's whole state (scale,
// hysteresis budget, step count, last overflow). Older ones kept the scale alone: it is taken,
// with the counts of a scaler that saw global_step steps and no overflow. A checkpoint saved without fp16 has none,
// and the scale starts at the config's.
StatusOr<std::optional<optim::DynamicLossScaler::State>> Engine::Impl::SavedScalerState(
    const checkpoint::Manifest& m, const std::string& mpath) const {
  if (!m.scaler.is_object() || !m.scaler.contains("scale")) {
    STRATA_LOG(WARN) << mpath << " was saved without fp16, so it holds no loss scale; this fp16 run "
                     << "starts at the config's (" << step_.scaler->scale() << ")";
    return std::optional<optim::DynamicLossScaler::State>();
  }
  optim::DynamicLossScaler::State st = step_.scaler->state();
  st.iteration = m.global_step;
  st.last_overflow_iteration = -1;
  // Each field must be a number of its kind first: nlohmann's get<int64_t>() of a double that
  // does not fit (1e300) is undefined behaviour.
  auto integer = [&](const char* key, int64_t* out) {
    const nlohmann::json& v = m.scaler.at(key);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT64_MAX))
      return false;
    *out = v.get<int64_t>();
    return true;
  };
  bool ok = false;
  try {
    ok = m.scaler.at("scale").is_number();
    if (ok) st.scale = m.scaler.at("scale").get<double>();
    if (ok && m.scaler.contains("iteration"))
      ok = integer("hysteresis_left", &st.hysteresis_left) && integer("iteration", &st.iteration) &&
           integer("last_overflow_iteration", &st.last_overflow_iteration);
  } catch (const nlohmann::json::exception&) {
    ok = false;
  }
  if (!ok)
    return DataLoss(StrCat(mpath, ": the loss scaler's state is malformed (",
                           m.scaler.dump().substr(0, 200), "); the checkpoint is damaged"));
  // Checked here on a copy, before anything loads; Restore applies it once the states are in.
  optim::DynamicLossScaler probe = *step_.scaler;
  if (Status s = probe.Restore(st); !s.ok())
    return DataLoss(StrCat(mpath, ": ", s.message(), "; the checkpoint is damaged"));
  return std::optional<optim::DynamicLossScaler::State>(st);
}

// Note [elastic resume]
// A checkpoint loads into a run of another world size, ZeRO stage or precision. Every state it
// keeps (the master, the moments) is a value per parameter element, and the manifests' layout
// section says where each parameter sat; the loading run walks its own shards and takes each
// parameter piece from whichever saving rank's file holds it (ReadRelaidBlocks, Note [loading
// another chunk layout] in saved_state_reader.cc). So a run saved on 2 ranks at stage 3 resumes
// on 1 rank at stage 2, or on 4, with every master and moment value as saved: the states are
// bit-exact, what the run does next is not the same run (its batches are split over other
// ranks). A rank the saving run did not have reads rank 0's manifest for the counters, the
// buffers and the client state. The working copy is the master rounded to this run's precision
// (the master is fp32 in every precision but bf16_master_weights_and_grads, which StateLayout
// converts); fp16's loss scale comes along when both runs are fp16 (Note [a saved loss scale]).
// The accumulation may differ too: the boundary count carries over (ResumedMicroStep).
// What cannot follow is a client optimizer's state, which is per rank and opaque to the engine.
Status Engine::Impl::CheckManifestFits(const checkpoint::Manifest& m, const std::string& dir) const {
  auto mismatch = [&](const std::string& what, const std::string& saved, const std::string& now,
                      const std::string& fix) {
    return InvalidArgument(StrCat(dir, " was saved with ", what, "=", saved, " but this run has ",
                                  what, "=", now, "; ", fix));
  };
  // Another optimizer-state layout is converted while loading (ReadSavedBlocks).
  STRATA_RETURN_IF_ERROR(StateLayout::Parse(m.state_dtype).status().WithContext(dir));
  std::vector<int64_t> ours;
  for (const ChunkInfo& ci : partitioner_->chunks()) ours.push_back(ci.shard_numel);
  if (m.parameters != num_params())
    return mismatch("a model of parameters", std::to_string(m.parameters), std::to_string(num_params()),
                    "it belongs to another model: use the same model");
  const bool other_ranks =
      m.world_size != comm_->world_size() || m.stage != config_.zero_optimization.stage;
  if (m.layout.is_null()) {
    // Older checkpoints load only into the shards that wrote them.
    if (other_ranks)
      return mismatch(
          "world_size and zero_optimization.stage", StrCat(m.world_size, " and ", m.stage),
          StrCat(comm_->world_size(), " and ", config_.zero_optimization.stage),
          "it predates the manifests' layout section, so it loads only into the ranks and "
          "stage that saved it");
    // Other chunks load parameter by parameter (ReadRelaidBlocks), given the layout section.
    if (m.shard_numel != ours)
      return mismatch(
          "chunks of shard sizes", StrCat(m.shard_numel.size(), " chunks"),
          StrCat(ours.size(), " chunks"),
          "it predates the manifests' layout section, so it loads only into the same "
          "chunks: use the strata.chunk_size and optimizer_state_dtype it was saved with");
  }
  if (other_ranks && m.extra.is_object() && m.extra.contains(kClientFileKey))
    return mismatch(
        "world_size and zero_optimization.stage", StrCat(m.world_size, " and ", m.stage),
        StrCat(comm_->world_size(), " and ", config_.zero_optimization.stage),
        "its client optimizer's state is saved per rank, so it resumes only on the ranks "
        "and stage that saved it; load_checkpoint(..., load_optimizer_states=False) takes "
        "the weights alone");
  return Status::Ok();
}

bool Engine::Impl::SameShards(const checkpoint::Manifest& m) const {
  const int saved_shard_world = m.stage == 0 ? 1 : m.world_size;
  return saved_shard_world == plan_.shard_world() && SameChunks(m);
}

int64_t Engine::Impl::ResumedMicroStep(const checkpoint::Manifest& m,
                                       const std::string& mpath) const {
  const int64_t ga = config_.gradient_accumulation_steps;
  const int64_t saved_ga = m.gradient_accumulation_steps;
  if (saved_ga == ga || (saved_ga == 0 && m.micro_step % ga == 0)) return m.micro_step;
  // Saves fall on boundaries, so the saved micro-steps are whole windows of the saved
  // accumulation; this run's windows start from the same count of boundaries.
  const int64_t boundaries = saved_ga > 0 ? m.micro_step / saved_ga : m.micro_step / ga;
  STRATA_LOG(INFO) << mpath << " was saved after " << m.micro_step << " micro-steps"
                   << (saved_ga > 0 ? StrCat(" of ", saved_ga, " per step") : std::string())
                   << "; this run accumulates " << ga << ", so it goes on from micro-step "
                   << boundaries * ga << " (" << boundaries << " steps, skipped ones included)";
  return boundaries * ga;
}

Status Engine::Impl::ReadSavedBuffers(int fd, const std::string& bin, const checkpoint::Manifest& m,
                                      const std::string& mpath, std::vector<torch::Tensor>* out) {
  // Every buffer the model has must be in the checkpoint, by name, with its size and type.
  for (size_t i = 0; i < buffers_.size(); ++i) {
    const auto& [name, b] = buffers_[i];
    const checkpoint::BufferEntry* e = nullptr;
    for (const auto& be : m.buffers)
      if (be.name == name) e = &be;
    if (!e)
      return DataLoss(StrCat(mpath, ": buffer '", name, "' (", c10::toString(b.scalar_type()), ", ",
                             b.nbytes(),
                             " bytes) is missing; the checkpoint belongs to another model"));
    STRATA_ASSIGN_OR_RETURN(torch::Tensor value,
                            ReadSavedTensor(fd, bin, *e, b, StrCat("buffer '", name, "'"), mpath));
    out->push_back(std::move(value));
  }
  return Status::Ok();
}

Status Engine::Impl::ReadSavedBlocks(int fd, const std::string& bin, const checkpoint::Manifest& m,
                                     const std::string& mpath, bool weights_only) {
  std::map<BlockKey, const checkpoint::BlockEntry*> entries;
  for (const auto& e : m.blocks) {
    STRATA_ASSIGN_OR_RETURN(StateKind k, KindFromName(e.state));
    entries[{e.chunk, k}] = &e;
  }
  // Note [compact layouts]: a checkpoint saved under another layout (fp32 states loaded into an
  // 8-bit run, or back) has its master and moments converted through fp32, and says so.
  STRATA_ASSIGN_OR_RETURN(const StateLayout saved, StateLayout::Parse(m.state_dtype));
  const StateLayout now = plan_.layout();
  if (saved != now)
    STRATA_LOG(WARN) << mpath << ": saved with optimizer-state layout " << saved.Name()
                     << "; converting its master and moments to this run's " << now.Name();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    for (StateKind kind : kSavedKinds) {
      if (weights_only && kind != StateKind::kMaster32) continue;  // the optimizer keeps its own
      if (!plan_.HoldsState(kind)) continue;  // a state this optimizer does not keep is not read
      const int64_t c64 = static_cast<int64_t>(c);
      auto it = entries.find({c64, kind});
      const int64_t n = partitioner_->chunks()[c].shard_numel;
      const bool layout_kind = kind == StateKind::kMaster32 || kind == StateKind::kExpAvg ||
                               kind == StateKind::kExpAvgSq;
      const uint64_t bytes = layout_kind ? saved.Bytes(kind, n) : SavedBytes(c64, kind);
      if (it == entries.end() || it->second->bytes != bytes)
        return DataLoss(StrCat(mpath, ": ", BlockName({c64, kind}), " is missing or has the wrong size"));
      // Read into a scratch buffer first: a damaged file must not overwrite the live state.
      std::vector<char> buf(bytes);
      STRATA_RETURN_IF_ERROR(checkpoint::ReadChecked(fd, bin, it->second->offset, bytes,
                                                     it->second->crc32c, BlockName({c64, kind}),
                                                     buf.data()));
      const bool converted = kind == StateKind::kMaster32 ? saved.bf16_master != now.bf16_master
                                                          : layout_kind && saved.moments != now.moments;
      if (converted) {
        std::vector<float> values(static_cast<size_t>(n));
        saved.Decode(kind, buf.data(), n, values.data());
        buf.assign(now.Bytes(kind, n), 0);
        now.Encode(kind, values.data(), n, buf.data());
      }
      STRATA_RETURN_IF_ERROR(WriteLoadedBlock(c64, kind, buf));
    }
  }
  return Status::Ok();
}

Status Engine::Impl::WriteLoadedBlock(int64_t c, StateKind kind, const std::vector<char>& bytes) {
  const BlockKey key = kind == StateKind::kMaster32 ? plan_.MasterKey(c) : BlockKey{c, kind};
  STRATA_ASSIGN_OR_RETURN(void* dst, store_->Acquire(key, Access::kWrite));
  step_.load_wrote = true;  // Note [a load cut short]
  Status s = WriteBlockBytes(dst, bytes.data(), bytes.size(), plan_.PlacementOf(c, key.kind));
  Status r = store_->Release(key, true);
  STRATA_RETURN_IF_ERROR(s);
  return r;
}

bool Engine::Impl::SameChunks(const checkpoint::Manifest& m) const {
  if (m.shard_numel.size() != chunks_.size()) return false;
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (m.shard_numel[c] != partitioner_->chunks()[c].shard_numel) return false;
  if (m.layout.is_null() || !m.layout.contains("params")) return true;  // checked by shard sizes
  const auto& saved = m.layout["params"];
  if (saved.size() != params_.size()) return false;
  for (size_t pid = 0; pid < params_.size(); ++pid) {
    const ParamLocation& loc = partitioner_->location(static_cast<int64_t>(pid));
    if (saved[pid].value("chunk", int64_t{-1}) != loc.chunk ||
        saved[pid].value("offset", int64_t{-1}) != loc.offset)
      return false;
    // Chunks padded alike can hold other shapes at the same offsets (two layers swapped), or other
    // parameters of the same shapes (another set of layers frozen): the parameter-by-parameter
    // path then names the difference.
    if (saved[pid].contains("shape") && saved[pid]["shape"] != nlohmann::json(params_[pid].shape))
      return false;
    if (saved[pid].contains("name") &&
        saved[pid]["name"] != partitioner_->param_name(static_cast<int64_t>(pid)))
      return false;
  }
  return true;
}

Status Engine::Impl::ReadRelaidBlocks(const std::string& dir, const checkpoint::Manifest& m,
                                      bool weights_only) {
  STRATA_ASSIGN_OR_RETURN(SavedStateReader saved, SavedStateReader::Open(dir, m));
  if (saved.params().size() != params_.size())
    return InvalidArgument(StrCat(dir, " holds ", saved.params().size(), " parameters and this model ",
                                  params_.size(), ": it belongs to another model"));
  for (size_t pid = 0; pid < params_.size(); ++pid) {
    const auto& sp = saved.params()[pid];
    const int64_t numel = partitioner_->location(static_cast<int64_t>(pid)).numel;
    const std::string name = partitioner_->param_name(static_cast<int64_t>(pid));
    if (sp.name != name || sp.numel != numel || sp.shape != params_[pid].shape)
      return InvalidArgument(
          StrCat(dir, ": parameter ", pid, " is '", sp.name, "' of shape ", ShapeText(sp.shape),
                 " there and '", name, "' of shape ", ShapeText(params_[pid].shape),
                 " here: it belongs to another model, or another set of its "
                 "parameters was frozen (requires_grad=False) when it was saved"));
  }
  const StateLayout now = plan_.layout();
  STRATA_LOG(WARN) << dir << ": saved in other chunks (another strata.chunk_size, or the parameter "
                   << "alignment of 8-bit moments); loading its states parameter by parameter"
                   << (saved.layout() != now ? StrCat(", saved with optimizer-state layout ", saved.layout().Name(),
                                                      ", converting its master and moments to this run's ", now.Name())
                                             : std::string());
  uint64_t saved_total = 0;
  for (StateKind kind : kSavedKinds) {
    if (weights_only && kind != StateKind::kMaster32) continue;
    if (!plan_.HoldsState(kind)) continue;
    if (!saved.Has(kind))
      return DataLoss(StrCat(dir, " holds no ", StateKindName(kind), ", which this run's optimizer keeps"));
    // 8-bit blocks saved at parameter boundaries, as this run lays them out: copied as they are.
    const bool copy_blocks = kind != StateKind::kMaster32 && saved.Int8BlocksAligned() &&
                             now.moments == optim::MomentFormat::kInt8;
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const int64_t c64 = static_cast<int64_t>(c);
      const int64_t n = partitioner_->chunks()[c].shard_numel;
      std::vector<char> buf(now.Bytes(kind, n), 0);  // blocks of no parameter: scale 0, all zero
      auto* codes = reinterpret_cast<uint8_t*>(buf.data());
      auto* scales = reinterpret_cast<float*>(buf.data() + optim::Int8ScaleOffset(static_cast<size_t>(n)));
      std::vector<float> values(copy_blocks ? 0 : static_cast<size_t>(n), 0.0f);  // padding stays zero
      for (const auto& pc : partitioner_->ShardPieces(c64, plan_.shard_rank())) {
        STRATA_RETURN_IF_ERROR(
            copy_blocks ? saved.ReadInt8Blocks(kind, pc.param, pc.in_param, pc.size, codes + pc.in_shard,
                                               scales + pc.in_shard / static_cast<int64_t>(optim::kInt8Block))
                        : saved.Read(kind, pc.param, pc.in_param, pc.size, values.data() + pc.in_shard));
      }
      if (!copy_blocks) now.Encode(kind, values.data(), n, buf.data());
      STRATA_RETURN_IF_ERROR(WriteLoadedBlock(c64, kind, buf));
    }
    saved_total += saved.SavedBytes(kind);
  }
  // What a rank reads is the shards its own overlap, not the checkpoint: said, as it is what a
  // load over many ranks costs each.
  STRATA_LOG(INFO) << dir << ": rank " << comm_->rank() << " read "
                   << FormatBytes(saved.bytes_read()) << " of the checkpoint's "
                   << FormatBytes(saved_total) << " of the states it loads";
  return Status::Ok();
}

}  // namespace strata
