#include "runtime/engine/zero_init.h"

#include <fcntl.h>
#include <malloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

#include "runtime/base/logging.h"
#include "runtime/base/units.h"

namespace strata::zero {

// Note [direct staging]
// A large model's start is bounded by the staging file: the 2026-11-27 H100 lease wrote it
// through the page cache at about 260 MB/s (dirty-page throttling on a disk that takes 3.9 GB/s
// with O_DIRECT), 4 minutes for 63 GiB. So Partition writes with O_DIRECT where the file system
// allows it: each parameter at a 4 KiB-aligned offset, through an aligned bounce buffer, its tail
// padded; ReadStaged reads it back the same way. StageMapped's parameters are mapped, so they
// keep the buffered descriptor (the kernel keeps the two views coherent). Where O_DIRECT is
// refused (tmpfs before Linux 6.6, some network file systems) or the first aligned write fails
// with EINVAL, the buffered path takes over.
// The alignment: O_DIRECT's 4 KiB, or the page where pages are larger, so that a directly
// written parameter never shares a page with a StageMapped one (whose dirty page's writeback
// would cover it).
uint64_t DirectAlign() {
  static const uint64_t align = std::max<uint64_t>(4096, static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)));
  return align;
}
constexpr size_t kBounceBytes = 8u << 20;  // a multiple of any page size
uint64_t AlignUp(uint64_t v) { return (v + DirectAlign() - 1) / DirectAlign() * DirectAlign(); }

class Init::Impl {
 public:
  ~Impl() {
    StopReporter();
    if (dfd >= 0) ::close(dfd);
    if (scratch_fd >= 0) ::close(scratch_fd);
    std::free(bounce);
    std::free(read_buf);
  }
  int fd = -1;
  int dfd = -1;  // the same file opened with O_DIRECT, or -1 (Note [direct staging])
  void* bounce = nullptr;  // kBounceBytes, DirectAlign()-aligned: Partition's writes through dfd
  bool any_direct = false;  // something was written through dfd: it stays open for the reads
  std::string path;
  uint64_t file_system = 0;  // the file's st_dev
  uint64_t block_size = 4096;  // its st_blksize: a punch frees whole blocks
  bool punches = false;      // the file system gives a punched range back (StagedDiskSpace)
  uint64_t end = 0;      // the file's end: the bytes written so far, with alignment padding
  // The staged values' bytes: written by the building thread, read by a progress reporter.
  std::atomic<uint64_t> payload{0};
  std::atomic<int64_t> params{0};
  // StageGenerated's parameters: their bytes in the staged dtype (nothing in the file) and count.
  std::atomic<uint64_t> generated{0};
  std::atomic<int64_t> generated_params{0};
  torch::Dtype staged_dtype = torch::kFloat32;  // floating-point parameters are written as this
  StageMode mode = StageMode::kValues;
  // ReadStaged's buffer, DirectAlign()-aligned and grown to the largest parameter read: one
  // buffer whose pages fault in once, where a fresh allocation per parameter faulted them in
  // again for every one (Note [staged reads]).
  std::mutex read_mu;
  void* read_buf = nullptr;
  uint64_t read_cap = 0;
  // StageMapped's descriptor for giving a released mapping's space back: a dup of fd that its
  // mappings share and that outlives the Init, closed with the last of them (Note [mapped
  // release]).
  std::shared_ptr<const int> mapped_fd;
  // StageMode::kShapesOnly: the memory file every scratch parameter's windows map, or -1 before
  // the first (Note [scratch parameters]); its mappings keep it alive after this closes it.
  int scratch_fd = -1;

  // Note [build progress]: a line every 10 s in which the build staged something.
  void StartReporter();
  void StopReporter();
  std::mutex report_mu;
  std::condition_variable report_cv;
  bool stopping = false;  // guarded by report_mu
  std::thread reporter;
};

namespace {

std::atomic<int64_t> progress_interval_ms{10000};  // SetProgressIntervalForTest

}  // namespace

// Note [build progress]
// A model built under an Init takes minutes at the sizes it is for (LibTorch's initializers draw
// a 20 B model's values on the CPU), and nothing else is printed meanwhile: the engine's own
// progress starts with Engine::Create. So a thread of the Init logs what has been staged every
// ten seconds, as the engine's start does, while the count grows; an interval in which nothing
// was staged (the model's code is busy elsewhere, or the build is over) prints nothing, and a
// build that printed ends with its totals when the Init goes. A rank that builds shapes only
// stages nothing and starts no thread.
void Init::Impl::StartReporter() {
  reporter = std::thread([this] {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string dir = std::filesystem::path(path).parent_path().string();
    uint64_t last = 0;
    bool said = false;
    auto say = [&] {
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      STRATA_LOG(INFO) << "zero::Init: " << FormatBytes(payload.load()) << " of " << params.load()
                       << " parameters staged in " << dir
                       << (generated_params.load() > 0
                               ? StrCat(", ", FormatBytes(generated.load()), " of ", generated_params.load(),
                                        " more to draw at the engine's start")
                               : std::string())
                       << ", " << static_cast<int>(secs) << " s";
    };
    std::unique_lock<std::mutex> l(report_mu);
    while (!report_cv.wait_for(l, std::chrono::milliseconds(progress_interval_ms.load()),
                               [this] { return stopping; })) {
      const uint64_t bytes = payload.load() + generated.load();
      if (bytes == last) continue;
      last = bytes;
      said = true;
      say();
    }
    // A build long enough to report ends with its totals.
    if (said && payload.load() + generated.load() != last) say();
  });
}

void Init::Impl::StopReporter() {
  if (!reporter.joinable()) return;
  {
    std::lock_guard<std::mutex> l(report_mu);
    stopping = true;
  }
  report_cv.notify_all();
  reporter.join();
}

namespace {

struct Staged {
  Init::Impl* owner;
  uint64_t offset;
  int64_t numel;
  torch::Dtype dtype;
  bool direct;  // written through O_DIRECT at an aligned offset: read back the same way
  bool dropped;  // StageMode::kShapesOnly: nothing was written; reads give zeros
  std::vector<int64_t> shape;  // the parameter's own, which now has 0 elements
  Fill fill;  // StageGenerated: the values are drawn when read, nothing is in the file
  // Note [registry keys]: keeps the key's address from being reused while the entry lives.
  c10::weak_intrusive_ptr<c10::TensorImpl> self{c10::intrusive_ptr<c10::TensorImpl>()};
};

// Note [registry keys]
// Entries are keyed by the parameter's TensorImpl address. A staged parameter can die before the
// engine reads it (a module built under the Init and dropped), and the allocator may then hand
// its address to a parameter built later: that one was skipped as "tied, staged already", and
// the engine would have read the dead one's values in its place. Each entry holds a weak
// reference to its TensorImpl, which keeps the object's memory (not its data) allocated while
// the entry lives, so no other TensorImpl can take the address; the Init's destructor drops the
// entries, and with them those references.

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<const c10::TensorImpl*, Staged>& Registry() {
  static std::unordered_map<const c10::TensorImpl*, Staged> r;
  return r;
}
// StageMapped's live mappings that hold space in a staging file, by their memory's address;
// each entry goes with its mapping (Note [mapped release]). Apart from Registry(): the deleter
// that erases one may run wherever a tensor dies, Mu() held or not.
std::mutex& MappedMu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<const void*, StagedSpace>& Mapped() {
  static std::unordered_map<const void*, StagedSpace> m;
  return m;
}
thread_local Init::Impl* current = nullptr;
c10::weak_intrusive_ptr<c10::TensorImpl> WeakOf(const torch::Tensor& t) {
  return c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
}
std::atomic<bool> direct_staging{true};  // SetDirectStagingForTest

Status PwriteAll(int fd, const void* data, size_t n, uint64_t off, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, StrCat("write zero::Init staging file ", path));
    }
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

// Writes `values` (a flat CPU tensor, converted on the way to the staged dtype) at the aligned
// `offset` through the O_DIRECT descriptor, in bounce-buffer pieces, the last one zero-padded
// to the alignment. Each piece is converted straight into the bounce buffer (LibTorch's copy_,
// on its intra-op threads), with no staged-dtype copy of the whole parameter in between.
// Returns false, having closed the direct descriptor, when the file system refuses the first
// aligned O_DIRECT write (EINVAL): the caller writes buffered instead. Other errors are
// returned.
StatusOr<bool> WriteDirect(Init::Impl& init, const torch::Tensor& values, uint64_t offset) {
  const int64_t esize = static_cast<int64_t>(c10::elementSize(init.staged_dtype));
  const int64_t per_piece = static_cast<int64_t>(kBounceBytes) / esize;
  const uint64_t bytes = static_cast<uint64_t>(values.numel() * esize);
  for (uint64_t done = 0; done < bytes;) {
    const int64_t first = static_cast<int64_t>(done) / esize;
    const int64_t count = std::min<int64_t>(per_piece, values.numel() - first);
    const uint64_t n = static_cast<uint64_t>(count * esize);
    torch::from_blob(init.bounce, {count}, torch::TensorOptions().dtype(init.staged_dtype))
        .copy_(values.narrow(0, first, count));
    const uint64_t len = AlignUp(n);
    std::memset(static_cast<char*>(init.bounce) + n, 0, len - n);
    for (uint64_t w = 0; w < len;) {
      ssize_t r = ::pwrite(init.dfd, static_cast<char*>(init.bounce) + w, len - w,
                           static_cast<off_t>(offset + done + w));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0 && errno == EINVAL && !init.any_direct && w == 0) {
        ::close(init.dfd);
        init.dfd = -1;
        return false;
      }
      // EINVAL once direct writes have worked, or after a short one: the kernel cut the request
      // to an unaligned length (a full disk, a file size limit). The same bytes through the
      // buffered descriptor either land (the kernel keeps the two views coherent) or fail with
      // the real cause, which is what the caller should see.
      if ((r < 0 && errno == EINVAL) ||
          (r >= 0 && static_cast<uint64_t>(r) < len - w && static_cast<uint64_t>(r) % DirectAlign() != 0)) {
        const uint64_t from = r > 0 ? w + static_cast<uint64_t>(r) : w;
        STRATA_RETURN_IF_ERROR(PwriteAll(init.fd, static_cast<char*>(init.bounce) + from, len - from,
                                         offset + done + from, init.path));
        break;
      }
      if (r < 0) return ErrnoToStatus(errno, StrCat("write zero::Init staging file ", init.path));
      w += static_cast<uint64_t>(r);
    }
    done += n;
  }
  init.any_direct = true;
  return true;
}

// Reads `len` (aligned) bytes written by WriteDirect at `offset` into `buf`.
Status ReadDirect(const Init::Impl& init, void* buf, uint64_t len, uint64_t offset) {
  for (uint64_t r = 0; r < len;) {
    ssize_t got = ::pread(init.dfd, static_cast<char*>(buf) + r, len - r, static_cast<off_t>(offset + r));
    if (got < 0 && errno == EINTR) continue;
    // The file ends aligned (every direct write is padded): a short or unaligned read means it
    // was cut.
    if (got == 0 || (got > 0 && static_cast<uint64_t>(got) % DirectAlign() != 0 &&
                     static_cast<uint64_t>(got) < len - r))
      return DataLoss(StrCat("zero::Init staging file ", init.path, " is truncated"));
    if (got < 0) return ErrnoToStatus(errno, StrCat("read zero::Init staging file ", init.path));
    r += static_cast<uint64_t>(got);
  }
  return Status::Ok();
}

// Reads `len` bytes written through the buffered descriptor at `offset` into `buf`.
Status ReadBuffered(const Init::Impl& init, void* buf, uint64_t len, uint64_t offset) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    ssize_t r = ::pread(init.fd, p, len, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return r < 0 ? ErrnoToStatus(errno, StrCat("read zero::Init staging file ", init.path))
                   : DataLoss(StrCat("zero::Init staging file ", init.path, " is truncated"));
    p += r;
    len -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

// Counts live Inits; the first switches glibc to the building policy, the last switches back.
void SetBuildingMallocPolicy(int delta) {
  static std::mutex mu;
  static int live = 0;
  std::lock_guard<std::mutex> l(mu);
  const int before = live;
  live += delta;
  if (before == 0 && live > 0) {
    ::mallopt(M_MMAP_THRESHOLD, 1 << 20);
  } else if (before > 0 && live == 0) {
    ::mallopt(M_MMAP_THRESHOLD, 32 << 20);
    ::mallopt(M_TRIM_THRESHOLD, 64 << 20);
  }
}

}  // namespace

StatusOr<std::unique_ptr<Init>> Init::Create(const std::string& dir, torch::Dtype staged_dtype,
                                             StageMode mode) {
  if (staged_dtype != torch::kFloat32 && staged_dtype != torch::kBFloat16)
    return InvalidArgument(StrCat("zero::Init stages parameters as fp32 or bf16, not ",
                                  c10::toString(staged_dtype)));
  if (current)
    return FailedPrecondition("a zero::Init is already current on this thread; destroy it first");
  if (mode == StageMode::kShapesOnly) {
    auto impl = std::make_unique<Impl>();
    impl->staged_dtype = staged_dtype;
    impl->mode = mode;
    SetBuildingMallocPolicy(+1);
    current = impl.get();
    return std::unique_ptr<Init>(new Init(std::move(impl)));
  }
  // The directory is the NVMe tier's (nvme_path), which the engine also refuses to create: a
  // mistyped path would put a model's worth of staging on whatever disk holds the typo.
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    return InvalidArgument(StrCat("zero::Init directory ", dir, " does not exist or is not a directory: "
                                  "create it, or fix the nvme_path"));
  auto impl = std::make_unique<Impl>();
  impl->staged_dtype = staged_dtype;
  std::string tmpl = (std::filesystem::path(dir) / "strata-zero-init.XXXXXX").string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  impl->fd = ::mkostemp(name.data(), O_CLOEXEC);
  if (impl->fd < 0) return ErrnoToStatus(errno, StrCat("create a staging file in ", dir));
  impl->path = name.data();
  impl->dfd = direct_staging.load() ? ::open(impl->path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC) : -1;
  if (impl->dfd >= 0) {
    // The path was reopened: it must still be the file mkostemp made (a shared directory).
    struct stat a {}, b {};
    const bool same = ::fstat(impl->fd, &a) == 0 && ::fstat(impl->dfd, &b) == 0 && a.st_dev == b.st_dev &&
                      a.st_ino == b.st_ino;
    if (!same || ::posix_memalign(&impl->bounce, DirectAlign(), kBounceBytes) != 0) {
      ::close(impl->dfd);
      impl->dfd = -1;
      impl->bounce = nullptr;
    }
  }
  ::unlink(impl->path.c_str());  // the open descriptor keeps it; nothing survives a crash
  // Whether ranges read back are given back to the disk: a punch of the still empty file fails
  // (EOPNOTSUPP) where the file system has no holes.
  struct stat st {};
  if (::fstat(impl->fd, &st) == 0) {
    impl->file_system = static_cast<uint64_t>(st.st_dev);
    if (st.st_blksize > 0) impl->block_size = static_cast<uint64_t>(st.st_blksize);
  }
  impl->punches = ::fallocate(impl->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096) == 0;
  // glibc raises its mmap threshold each time a large mmapped block is freed, after which
  // same-sized tensors come from the heap and their pages stay in the process when freed: a
  // model built unit by unit would still climb to several units' worth of RSS. While an Init is
  // alive a fixed 1 MiB threshold sends every tensor of 1 MiB or more back to the OS when it is
  // freed. Not for longer: every such tensor is then a fresh mapping whose pages fault in zeroed,
  // which doubled a training step of a d_model-256 GPT (0.20 -> 0.40 s, activations of 1-4 MiB).
  // The last Init to go sets the ceiling glibc's own adaptive threshold would reach (32 MiB, trim
  // at 64 MiB), so training reuses heap memory again.
  SetBuildingMallocPolicy(+1);
  impl->StartReporter();
  current = impl.get();
  return std::unique_ptr<Init>(new Init(std::move(impl)));
}

Init::Init(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Init::~Init() {
  {
    std::lock_guard<std::mutex> l(Mu());
    for (auto it = Registry().begin(); it != Registry().end();) {
      if (it->second.owner == impl_.get()) it = Registry().erase(it);
      else ++it;
    }
  }
  if (current == impl_.get()) current = nullptr;
  if (impl_->fd >= 0) ::close(impl_->fd);
  SetBuildingMallocPolicy(-1);
}

uint64_t Init::staged_bytes() const { return impl_->payload; }
uint64_t Init::generated_bytes() const { return impl_->generated; }
int64_t Init::generated_params() const { return impl_->generated_params; }
StageMode Init::mode() const { return impl_->mode; }
bool Init::direct_io() const { return impl_->dfd >= 0; }
int64_t Init::staged_params() const { return impl_->params; }

namespace {

// Drops the parameter's memory: it keeps its dtype and has 0 elements, as a released stage-3
// parameter does (Note [released parameters]); its shape is in its Registry entry. Sizes over a
// storage without memory would make any op that reads it read from address 0.
void DropMemory(torch::Tensor& p) { p.set_data(torch::empty({0}, p.options())); }

}  // namespace

void Partition(torch::nn::Module& unit) {
  Init::Impl* init = current;
  if (!init) return;
  torch::NoGradGuard ng;
  for (auto& p : unit.parameters(/*recurse=*/true)) {
    if (!p.requires_grad() || p.numel() == 0) continue;
    {
      std::lock_guard<std::mutex> l(Mu());
      if (Registry().count(p.unsafeGetTensorImpl())) continue;  // tied: staged with its first unit
    }
    if (init->mode == StageMode::kShapesOnly) {
      {
        std::lock_guard<std::mutex> l(Mu());
        Registry()[p.unsafeGetTensorImpl()] = {init, 0, p.numel(), p.scalar_type(), false, true,
                                               p.sizes().vec(), nullptr, WeakOf(p)};
      }
      ++init->params;
      DropMemory(p);
      continue;
    }
    const torch::Tensor flat = p.detach().to(torch::kCPU).contiguous().view({-1});
    const torch::Dtype dtype = flat.is_floating_point() ? init->staged_dtype : flat.scalar_type();
    const uint64_t bytes = static_cast<uint64_t>(flat.numel()) * c10::elementSize(dtype);
    uint64_t offset = init->end;
    bool direct = false;
    if (init->dfd >= 0 && dtype == init->staged_dtype) {
      offset = AlignUp(init->end);
      StatusOr<bool> wrote = WriteDirect(*init, flat, offset);
      if (!wrote.ok()) throw std::runtime_error(wrote.status().ToString());
      direct = *wrote;
      if (!direct) offset = init->end;  // O_DIRECT refused: buffered from here on
    }
    if (!direct) {
      const torch::Tensor host = flat.to(dtype);
      Status s = PwriteAll(init->fd, host.data_ptr(), bytes, offset, init->path);
      if (!s.ok()) throw std::runtime_error(s.ToString());
    }
    {
      std::lock_guard<std::mutex> l(Mu());
      Registry()[p.unsafeGetTensorImpl()] = {init, offset, p.numel(), dtype, direct, false,
                                             p.sizes().vec(), nullptr, WeakOf(p)};
    }
    init->end = offset + (direct ? AlignUp(bytes) : bytes);
    init->payload += bytes;
    ++init->params;
    DropMemory(p);
  }
}

// Note [generated parameters]
// The staging file held the whole model at start, and a disk that could hold the run's NVMe
// state could not always hold that file too: on the H100 machine's 64 GiB disk it stopped three
// of the compact layouts' largest models (fp32 staging at 17 B parameters). Most of a large
// model's bytes are its big matrices, and strata-train draws those from a counter-based
// generator (ParallelNormal): their values are a function of a key, a mean and a std. So such
// a parameter is registered with that function instead of its values, and ReadStaged draws it
// when the engine reads it, chunk by chunk: the matrices never touch the disk, and the work of
// drawing them moves from the build to the engine's start, where it replaces a write and a read
// of the same bytes. The values pass through the staged dtype on the way (fp32 -> bf16 -> dst
// for a bf16 staging file), so the engine starts from exactly the bits the file would have held.
bool StageGenerated(const torch::Tensor& param, std::vector<int64_t> shape, Fill fill) {
  Init::Impl* init = current;
  if (!init) return false;
  if (!param.is_floating_point())
    throw std::invalid_argument(StrCat("zero::StageGenerated: a floating-point parameter, not ",
                                       c10::toString(param.scalar_type())));
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) throw std::invalid_argument("zero::StageGenerated: a shape with a negative size");
    numel *= d;
  }
  const bool dropped = init->mode == StageMode::kShapesOnly;
  {
    std::lock_guard<std::mutex> l(Mu());
    Registry()[param.unsafeGetTensorImpl()] = {init,  0,     numel, init->staged_dtype, false, dropped,
                                               shape, dropped ? nullptr : std::move(fill), WeakOf(param)};
  }
  torch::Tensor p = param;  // set_data is not const; the change lands on the shared TensorImpl
  DropMemory(p);
  if (!dropped) {
    init->generated += static_cast<uint64_t>(numel) * c10::elementSize(init->staged_dtype);
    ++init->generated_params;
  } else {
    ++init->params;
  }
  return true;
}

namespace {

// Note [scratch parameters]
// A rank > 0's Python Init (StageMode::kShapesOnly) stages nothing: the engine's start
// broadcasts rank 0's values over every chunk, so what the other ranks build is never read.
// Those ranks must still hold writable parameters of their full shapes while the model is built,
// because models write them (the init pass at the end of a constructor, transformers'
// initialize_weights inside GatheredParameters on every rank) and read their shapes. Kept as
// they were built, the whole model sat in each such rank's anonymous memory; staged to a file as
// on rank 0, each rank sharing a disk wrote the model once more. So their memory is a window of
// kScratchBytes repeated: one memory file of that size, mapped shared over each parameter's
// address range window by window. Every write lands in the same 32 MiB, whatever the model's
// size; what a read gives is whatever some parameter wrote last. The address space is reserved
// (PROT_NONE, no swap reserved) and costs nothing. Each parameter of a page or more takes
// ceil(its bytes / 32 MiB) mappings: a model of P bytes in N such parameters takes at most
// N + P / 32 MiB, inside the kernel's default of 65530 for models of thousands of parameters up
// to a terabyte; where a mapping fails the parameter keeps its own memory, as before. The
// engine gives trainable parameters memory of its own, and receives frozen ones into fresh
// memory (PlaceBuffers), so no rank reads a window after the start.
constexpr uint64_t kScratchBytes = uint64_t{32} << 20;  // a multiple of any page size

// `span` bytes (whole pages) of address space whose every kScratchBytes window maps the scratch
// file; nullptr when the kernel refuses (no memfd, or no mappings left).
void* MapScratch(Init::Impl& init, uint64_t span) {
  if (init.scratch_fd < 0) {
    const int fd = ::memfd_create("strata-zero-init-scratch", MFD_CLOEXEC);
    if (fd < 0) return nullptr;
    if (::ftruncate(fd, static_cast<off_t>(kScratchBytes)) != 0) {
      const int err = errno;
      ::close(fd);
      errno = err;
      return nullptr;
    }
    init.scratch_fd = fd;
  }
  void* base = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  for (uint64_t at = 0; at < span; at += kScratchBytes) {
    void* want = static_cast<char*>(base) + at;
    void* got = ::mmap(want, std::min(kScratchBytes, span - at), PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_FIXED, init.scratch_fd, 0);
    if (got != want) {
      const int err = errno;
      ::munmap(base, span);
      errno = err;
      return nullptr;
    }
  }
  return base;
}

// StageMapped under StageMode::kShapesOnly (Note [scratch parameters]).
void StageScratch(Init::Impl& init, const torch::Tensor& param) {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t bytes = param.nbytes();
  if (bytes < page) return;  // a mapping to save less than a page: it keeps its memory
  const uint64_t span = (bytes + page - 1) / page * page;
  void* m = MapScratch(init, span);
  if (m == nullptr) {
    STRATA_LOG_ONCE(WARN) << "zero::Init on a rank > 0: a parameter could not be mapped onto the "
                             "scratch region (errno "
                          << errno << "); such parameters keep their memory";
    return;
  }
  ++init.params;
  torch::Tensor scratch = torch::from_blob(
      m, param.sizes(), [span](void* p) { ::munmap(p, span); }, torch::TensorOptions().dtype(param.dtype()));
  torch::Tensor p = param;  // set_data is not const; the change lands on the shared TensorImpl
  p.set_data(scratch);
}

}  // namespace

// Note [mapped release]
// A StageMapped parameter's range of the file was held until the process dropped the whole
// file, long after the engine had copied the values out and pointed the parameter at its own
// memory: the start's disk peak was the whole staging file beside every NVMe block written. Each
// mapping's deleter now punches its own range after unmapping it, which also drops its dirty
// pages unwritten. The range is whole pages, and the file's end moves past its last one, so no
// parameter staged after it (mapped, or written by Partition) shares a page with it. The file
// stays open through a descriptor the mappings share, so a release after the Init has closed
// still finds it; the last release closes it. A forked child inherits the mappings and that
// descriptor but not the file's use: its releases do not punch. Punching is best effort: a file
// system without holes keeps the space until then, as before.
void StageMapped(const torch::Tensor& param) {
  Init::Impl* init = current;
  if (!init || param.numel() == 0) return;
  if (init->mode == StageMode::kShapesOnly) {
    StageScratch(*init, param);
    return;
  }
  if (!init->mapped_fd) {
    const int dup_fd = ::fcntl(init->fd, F_DUPFD_CLOEXEC, 0);
    if (dup_fd < 0)
      throw std::runtime_error(ErrnoToStatus(errno, StrCat("duplicate zero::Init staging file ", init->path)).ToString());
    init->mapped_fd = std::shared_ptr<const int>(new int(dup_fd), [](const int* fd) {
      ::close(*fd);
      delete fd;
    });
  }
  torch::NoGradGuard ng;
  torch::Tensor host = param.detach().to(torch::kCPU).contiguous();
  const uint64_t bytes = host.nbytes();
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t off = (init->end + page - 1) / page * page;  // mmap offsets are page-aligned
  Status s = PwriteAll(init->fd, host.data_ptr(), bytes, off, init->path);
  if (!s.ok()) throw std::runtime_error(s.ToString());
  void* m = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, init->fd, static_cast<off_t>(off));
  if (m == MAP_FAILED)
    throw std::runtime_error(ErrnoToStatus(errno, StrCat("map zero::Init staging file ", init->path)).ToString());
  // The range this parameter owns: whole pages, none shared with a later one (Note [mapped
  // release]).
  const uint64_t span = (bytes + page - 1) / page * page;
  init->end = off + span;
  init->payload += bytes;
  ++init->params;
  // The mapping keeps the (unlinked) file alive after the Init closes it; the last tensor using
  // the memory unmaps it and gives its range back.
  if (init->punches) {
    std::lock_guard<std::mutex> l(MappedMu());
    Mapped()[m] = StagedSpace{span, init->file_system, /*given_back_on_read=*/false};
  }
  torch::Tensor mapped = torch::from_blob(
      m, param.sizes(),
      [bytes, span, off, fd = init->mapped_fd, owner = ::getpid()](void* p) {
        {
          std::lock_guard<std::mutex> l(MappedMu());
          Mapped().erase(p);
        }
        ::munmap(p, bytes);
        if (::getpid() == owner)
          ::fallocate(*fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off),
                      static_cast<off_t>(span));
      },
      host.options());
  torch::Tensor p = param;  // set_data is not const; the change lands on the shared TensorImpl
  p.set_data(mapped);
}

void SetDirectStagingForTest(bool enabled) { direct_staging.store(enabled); }
void SetProgressIntervalForTest(int64_t ms) { progress_interval_ms.store(ms); }

bool IsStaged(const torch::Tensor& param) {
  std::lock_guard<std::mutex> l(Mu());
  return Registry().count(param.unsafeGetTensorImpl()) > 0;
}

std::optional<StagedSpace> StagedDiskSpace(const torch::Tensor& param) {
  {
    std::lock_guard<std::mutex> l(Mu());
    auto it = Registry().find(param.unsafeGetTensorImpl());
    if (it != Registry().end()) {
      const Staged& st = it->second;
      if (st.dropped || st.fill || !st.owner->punches) return std::nullopt;
      const uint64_t bytes = static_cast<uint64_t>(st.numel) * c10::elementSize(st.dtype);
      if (st.direct) return StagedSpace{AlignUp(bytes), st.owner->file_system, true};
      // A buffered range need not be block-aligned: a punch frees only the whole blocks inside.
      const uint64_t blk = st.owner->block_size;
      const uint64_t first = (st.offset + blk - 1) / blk * blk, last = (st.offset + bytes) / blk * blk;
      if (last <= first) return std::nullopt;
      return StagedSpace{last - first, st.owner->file_system, true};
    }
  }
  if (!param.has_storage() || param.storage().data() == nullptr) return std::nullopt;
  std::lock_guard<std::mutex> l(MappedMu());
  auto it = Mapped().find(param.storage().data());
  if (it == Mapped().end()) return std::nullopt;
  return it->second;
}

bool StagedMappingLive(const void* data) {
  std::lock_guard<std::mutex> l(MappedMu());
  return Mapped().count(data) > 0;
}

// Note [staged reads]
// Each staged parameter comes back through the Init's one read buffer (aligned for O_DIRECT,
// grown to the largest parameter), converted into the caller's tensor, then its file range is
// punched. While an Init lives glibc's mmap threshold is 1 MiB, so a fresh buffer per parameter
// was a fresh mapping whose pages all faulted in (and were zeroed) again: on a 20B model that is
// tens of GB of page faults for nothing.
std::optional<std::vector<int64_t>> StagedShape(const torch::Tensor& param) {
  std::lock_guard<std::mutex> l(Mu());
  auto it = Registry().find(param.unsafeGetTensorImpl());
  if (it == Registry().end()) return std::nullopt;
  return it->second.shape;
}

namespace {

// Grows the Init's read buffer (Note [staged reads]) to at least `len` bytes; the caller holds
// read_mu.
Status GrowReadBuffer(Init::Impl& init, uint64_t len) {
  if (len <= init.read_cap) return Status::Ok();
  std::free(init.read_buf);
  init.read_buf = nullptr;
  init.read_cap = 0;
  const uint64_t cap = std::max<uint64_t>(len, DirectAlign());
  if (::posix_memalign(&init.read_buf, DirectAlign(), cap) != 0)
    return ResourceExhausted(StrCat("allocating ", len, " bytes to read zero::Init staging file ", init.path));
  init.read_cap = cap;
  return Status::Ok();
}

// Copies flat `src` into `out` (which may be `src`) rounded through `dtype`, a piece at a time
// so that each piece's temporary comes from the heap.
void CopyThrough(torch::Tensor& out, const torch::Tensor& src, torch::Dtype dtype) {
  constexpr int64_t kPiece = int64_t{1} << 17;
  for (int64_t i = 0; i < src.numel(); i += kPiece) {
    const int64_t n = std::min(kPiece, src.numel() - i);
    out.narrow(0, i, n).copy_(src.narrow(0, i, n).to(dtype));
  }
}

// Draws a StageGenerated parameter into `dst` through the staged dtype (Note [generated
// parameters]): straight into an fp32 destination (rounded there through a bf16 file's dtype),
// otherwise into the Init's read buffer and converted from there.
StatusOr<bool> ReadGenerated(Init::Impl& init, const Staged& st, torch::Tensor dst) {
  torch::NoGradGuard ng;
  torch::Tensor out = dst.view({-1});
  if (out.scalar_type() == torch::kFloat32) {
    st.fill(out);
    if (st.dtype != torch::kFloat32) CopyThrough(out, out, st.dtype);
    return true;
  }
  std::lock_guard<std::mutex> l(init.read_mu);
  STRATA_RETURN_IF_ERROR(GrowReadBuffer(init, static_cast<uint64_t>(st.numel) * sizeof(float)));
  torch::Tensor drawn = torch::from_blob(init.read_buf, {st.numel}, torch::kFloat32);
  st.fill(drawn);
  if (st.dtype == torch::kFloat32 || out.scalar_type() == st.dtype)
    out.copy_(drawn);  // one rounding, as the file's write then a same-dtype read
  else
    CopyThrough(out, drawn, st.dtype);  // fp16 from a bf16 file: rounded twice, as the file's
  return true;
}

}  // namespace

namespace {

// The bytes of `st`'s range in its file (O_DIRECT's alignment included).
uint64_t StagedFileBytes(const Staged& st) {
  const uint64_t bytes = static_cast<uint64_t>(st.numel) * c10::elementSize(st.dtype);
  return st.direct ? AlignUp(bytes) : bytes;
}

// Drops `st`'s pages from the page cache (best effort): read once, or kept for a restore that
// would read them again from the file, they need not crowd out the tiers' memory.
void DropCachedRange(const Staged& st) {
  if (st.dropped || st.fill) return;
  ::posix_fadvise(st.owner->fd, static_cast<off_t>(st.offset),
                  static_cast<off_t>(static_cast<uint64_t>(st.numel) * c10::elementSize(st.dtype)),
                  POSIX_FADV_DONTNEED);
}

// Frees `st`'s range of its file (the staging file shrinks as the tiers fill, so the disk holds
// the model about once) and drops its pages from the cache. Both are best effort.
void GiveBackRange(const Staged& st) {
  if (st.dropped || st.fill) return;
  ::fallocate(st.owner->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
              static_cast<off_t>(st.offset), static_cast<off_t>(StagedFileBytes(st)));
  DropCachedRange(st);
}

}  // namespace

StatusOr<bool> ReadStaged(const torch::Tensor& param, torch::Tensor dst, AfterRead after) {
  Staged st;
  {
    // kGiveBack consumes the entry: from then on the parameter is the engine's. kKeep leaves it
    // for GiveBackStaged, or for a read by the next start if this one fails.
    std::lock_guard<std::mutex> l(Mu());
    auto it = Registry().find(param.unsafeGetTensorImpl());
    if (it == Registry().end()) return false;
    if (!dst.device().is_cpu() || !dst.is_contiguous() || dst.numel() != it->second.numel)
      return InvalidArgument(StrCat("ReadStaged: the destination must be a contiguous CPU tensor of ",
                                    it->second.numel, " elements, not ", dst.toString(), " ",
                                    dst.sizes()));
    st = it->second;
    if (after == AfterRead::kGiveBack) Registry().erase(it);
  }
  if (st.dropped) {
    dst.zero_();
    return true;
  }
  Init::Impl& init = *st.owner;
  if (st.fill) return ReadGenerated(init, st, dst);
  const uint64_t len = StagedFileBytes(st);
  std::lock_guard<std::mutex> l(init.read_mu);
  STRATA_RETURN_IF_ERROR(GrowReadBuffer(init, len));
  // The direct descriptor lives as long as its Init once anything went through it.
  STRATA_RETURN_IF_ERROR(st.direct ? ReadDirect(init, init.read_buf, len, st.offset)
                                   : ReadBuffered(init, init.read_buf, len, st.offset));
  if (after == AfterRead::kGiveBack) {
    GiveBackRange(st);
  } else {
    DropCachedRange(st);
  }
  torch::NoGradGuard ng;
  dst.view({-1}).copy_(torch::from_blob(init.read_buf, {st.numel}, torch::TensorOptions().dtype(st.dtype)));
  return true;
}

void GiveBackStaged(const torch::Tensor& param) {
  std::lock_guard<std::mutex> l(Mu());  // held: the entry's Init cannot go meanwhile
  auto it = Registry().find(param.unsafeGetTensorImpl());
  if (it == Registry().end()) return;
  GiveBackRange(it->second);
  Registry().erase(it);
}

}  // namespace strata::zero
