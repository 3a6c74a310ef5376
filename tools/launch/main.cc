// strata-launch: starts N local ranks of a command with the torchrun-style environment, prefixes
// their output, forwards signals, and tears everything down when one rank fails.
//
// Note [launcher teardown]
// A rank that fails leaves its peers blocked in a collective until their timeout; waiting for
// that wastes the timeout and, with NCCL, GPU time. So the first rank to exit non-zero (or by a
// signal) makes the launcher send SIGTERM to every other rank's process group, then SIGKILL after
// --grace seconds, and exit with the failed rank's code (128+signal for a signal). A rank that
// exits 0 early is not a failure: its peers either finish or fail on their own (their
// collectives return an error within strata.comm_timeout_s), which is what the multi-process
// fault test relies on.
//
// Note [an interrupted rank]
// A rank that ends on SIGINT or SIGTERM (exit 130 or 143, or killed by them) with no signal sent
// to the launcher is not torn down against at once: strata-train's ranks agree on a stop after
// each step, so a signal reaching one rank stops all of them after the same step and checkpoint.
// The others get --grace seconds to stop on their own; those still running then are torn down as
// above, and the launcher exits with the interrupted rank's code.
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace {

constexpr const char* kHelpFooter = R"(
Each rank runs CMD with MASTER_ADDR=127.0.0.1, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
LOCAL_WORLD_SIZE set; its stdout and stderr lines are prefixed with "[rank R] ". SIGINT and
SIGTERM are forwarded to every rank. When a rank fails, the others get SIGTERM, then SIGKILL after
--grace seconds, and strata-launch exits with the failed rank's code. A rank that stopped on an
interrupt of its own (exit 130 or 143) gives the others --grace seconds to stop too first.

Example:
  strata-launch --nproc 2 -- strata-train --config configs/tiny.json

More than one machine: strata-launch only starts local ranks. Use an external launcher that sets
the same variables on every node, with MASTER_ADDR naming node 0 and RANK unique across nodes:
  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint node0:29500 strata-train ...
  srun (Slurm): export MASTER_ADDR=$(scontrol show hostnames | head -1) MASTER_PORT=29500
                WORLD_SIZE=$SLURM_NTASKS RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID
  mpirun: map OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK to RANK/WORLD_SIZE/LOCAL_RANK in a wrapper.
Set GLOO_SOCKET_IFNAME to pick the network interface Gloo uses across machines.)";

struct Rank {
  pid_t pid = -1;
  bool running = false;
  int status = 0;         // waitpid status once exited
  int fds[2] = {-1, -1};  // read ends of the stdout and stderr pipes
  std::string partial[2];  // an unfinished line per stream
};

void Die(const std::string& msg) {
  std::fprintf(stderr, "strata-launch: %s\n", msg.c_str());
  std::exit(2);
}

void WriteAll(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own stdout is gone: nothing left to report to
    done += static_cast<size_t>(n);
  }
}

// Binds port 0 on loopback to let the kernel pick a free port. Another process could take it
// before rank 0 binds it; the store then fails with a clear "address in use" error.
int PickFreePort() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  if (s < 0) Die(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Die(std::string("picking a free port: ") + std::strerror(errno));
  }
  close(s);
  return ntohs(addr.sin_port);
}

int ExitCodeOf(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string Describe(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  }
  return "stopped";
}

// Emits the complete lines of `data` with the rank prefix; keeps the rest for later.
void EmitLines(int rank, int stream, std::string* partial, const char* data, size_t len,
               bool flush) {
  partial->append(data, len);
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  std::string out;
  size_t start = 0;
  for (size_t nl; (nl = partial->find('\n', start)) != std::string::npos; start = nl + 1) {
    out += prefix;
    out.append(*partial, start, nl + 1 - start);
  }
  partial->erase(0, start);
  if (flush && !partial->empty()) {
    out += prefix + *partial + "\n";
    partial->clear();
  }
  if (!out.empty()) WriteAll(stream == 0 ? STDOUT_FILENO : STDERR_FILENO, out);
}

pid_t SpawnRank(int rank, int nproc, int port, const std::vector<std::string>& cmd, int out_fd,
                int err_fd, const sigset_t& old_mask) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) Die(std::string("fork: ") + std::strerror(errno));
  if (pid > 0) return pid;
  // Child: own process group (so teardown reaches the rank's own children), default signals.
  setpgid(0, 0);
  // A launcher that dies without its teardown (SIGKILL, OOM) takes the rank with it: an orphan
  // rank would wait in a collective for peers that are gone, holding its memory and GPU. The
  // check after covers a launcher that died before the request.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(127);
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  dup2(out_fd, STDOUT_FILENO);
  dup2(err_fd, STDERR_FILENO);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  execvp(argv[0], argv.data());
  std::fprintf(stderr, "strata-launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
  _exit(127);
}

// The ranks' supervisor: starts them, relays their output line by line, forwards signals, and
// on the first failure (or an interrupt) tears the others down, SIGTERM then SIGKILL after the
// grace period. Run() returns strata-launch's exit code.
class Supervisor {
 public:
  Supervisor(int nproc, int port, double grace_s, std::vector<std::string> cmd)
      : nproc_(nproc), port_(port), grace_s_(grace_s), cmd_(std::move(cmd)), ranks_(nproc) {}

  int Run() {
    Start();
    for (;;) {
      std::vector<pollfd> pfds;
      std::vector<std::pair<int, int>> owners;  // (rank, stream) of each pollfd after the first
      int running = 0;
      const int open_fds = PollSet(&pfds, &owners, &running);
      if (running == 0 && open_fds == 0) break;
      // A rank's own children may hold its pipes open after it exits: give them a moment, then
      // stop.
      if (running == 0 && drain_until_ == Clock::time_point::max())
        drain_until_ = Clock::now() + std::chrono::seconds(2);
      if (running == 0 && Clock::now() >= drain_until_) break;
      int timeout_ms = -1;
      for (const auto [pending, at] :
           {std::pair{kill_pending_, kill_at_}, std::pair{term_pending_, term_at_}}) {
        if (!pending) continue;
        const int ms = static_cast<int>(std::max<int64_t>(
            0, std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count()));
        timeout_ms = timeout_ms < 0 ? ms : std::min(timeout_ms, ms);
      }
      if (running == 0) timeout_ms = 100;
      const int n = poll(pfds.data(), pfds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) Die(std::string("poll: ") + std::strerror(errno));
      if (kill_pending_ && Clock::now() >= kill_at_) {
        SignalAll(SIGKILL);
        kill_pending_ = false;
      }
      if (term_pending_ && Clock::now() >= term_at_) {
        term_pending_ = false;
        if (running > 0) {
          std::fprintf(stderr,
                       "strata-launch: the other ranks did not stop within %gs; terminating them\n",
                       grace_s_);
          StartTeardown(SIGTERM);
        }
      }
      RelayOutput(pfds, owners);
      if (pfds[0].revents & POLLIN) TakeSignals();
      Reap();
    }
    if (failed_rank_ >= 0) return failed_code_ == 0 ? 1 : failed_code_;
    if (received_signal_ != 0) return 128 + received_signal_;
    for (const Rank& r : ranks_) {
      if (ExitCodeOf(r.status) != 0) return ExitCodeOf(r.status);
    }
    return 0;
  }

 private:
  using Clock = std::chrono::steady_clock;

  // Signals arrive through a signalfd so the poll loop sees them in order with output; then
  // every rank starts with its stdout and stderr on pipes of ours.
  void Start() {
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGHUP);
    sigprocmask(SIG_BLOCK, &mask, &old_mask_);
    sig_fd_ = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sig_fd_ < 0) Die(std::string("signalfd: ") + std::strerror(errno));
    signal(SIGPIPE, SIG_IGN);
    for (int r = 0; r < nproc_; ++r) {
      int out[2], err[2];
      if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0) {
        Die(std::string("pipe: ") + std::strerror(errno));
      }
      ranks_[r].pid = SpawnRank(r, nproc_, port_, cmd_, out[1], err[1], old_mask_);
      setpgid(ranks_[r].pid, ranks_[r].pid);  // also here: no race with an early kill(-pid)
      ranks_[r].running = true;
      close(out[1]);
      close(err[1]);
      ranks_[r].fds[0] = out[0];
      ranks_[r].fds[1] = err[0];
    }
  }

  // The signalfd first, then every rank's open pipe; returns how many pipes are open.
  int PollSet(std::vector<pollfd>* pfds, std::vector<std::pair<int, int>>* owners, int* running) {
    int open_fds = 0;
    pfds->push_back({sig_fd_, POLLIN, 0});
    for (int r = 0; r < nproc_; ++r) {
      *running += ranks_[r].running;
      for (int s = 0; s < 2; ++s) {
        if (ranks_[r].fds[s] < 0) continue;
        ++open_fds;
        pfds->push_back({ranks_[r].fds[s], POLLIN, 0});
        owners->emplace_back(r, s);
      }
    }
    return open_fds;
  }

  void RelayOutput(const std::vector<pollfd>& pfds, const std::vector<std::pair<int, int>>& owners) {
    for (size_t i = 1; i < pfds.size(); ++i) {
      if (!(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      auto [r, s] = owners[i - 1];
      char buf[65536];
      const ssize_t got = read(ranks_[r].fds[s], buf, sizeof(buf));
      if (got > 0) {
        EmitLines(r, s, &ranks_[r].partial[s], buf, static_cast<size_t>(got), false);
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        EmitLines(r, s, &ranks_[r].partial[s], nullptr, 0, true);
        close(ranks_[r].fds[s]);
        ranks_[r].fds[s] = -1;
      }
    }
  }

  void TakeSignals() {
    signalfd_siginfo info;
    while (read(sig_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) continue;  // reaped below
      if (received_signal_ != 0) {
        SignalAll(SIGKILL);  // a second interrupt: stop waiting for a clean exit
      } else {
        received_signal_ = sig;
        std::fprintf(stderr, "strata-launch: got %s, forwarding to all ranks\n", strsignal(sig));
        StartTeardown(sig);
      }
      break;
    }
  }

  void Reap() {
    for (;;) {
      int status = 0;
      const pid_t pid = waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      for (int r = 0; r < nproc_; ++r) {
        if (ranks_[r].pid != pid || !ranks_[r].running) continue;
        ranks_[r].running = false;
        ranks_[r].status = status;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed_rank_ < 0 && received_signal_ == 0) {
          failed_rank_ = r;
          failed_code_ = ExitCodeOf(status);
          // Note [an interrupted rank]: the others are likely stopping too.
          if (failed_code_ == 128 + SIGINT || failed_code_ == 128 + SIGTERM) {
            std::fprintf(
                stderr,
                "strata-launch: rank %d stopped on an interrupt (%s); the other ranks have "
                "%gs to stop too\n",
                r, Describe(status).c_str(), grace_s_);
            term_pending_ = true;
            term_at_ =
                Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s_ * 1000));
          } else {
            std::fprintf(stderr, "strata-launch: rank %d %s; terminating the other ranks\n", r,
                         Describe(status).c_str());
            StartTeardown(SIGTERM);
          }
        }
      }
    }
  }

  void SignalAll(int sig) {
    for (const Rank& r : ranks_) {
      if (r.running) kill(-r.pid, sig);
    }
  }

  void StartTeardown(int sig) {
    SignalAll(sig);
    if (!kill_pending_) {
      kill_pending_ = true;
      kill_at_ = Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(grace_s_ * 1000));
    }
  }

  const int nproc_, port_;
  const double grace_s_;
  const std::vector<std::string> cmd_;
  std::vector<Rank> ranks_;
  int sig_fd_ = -1;
  sigset_t old_mask_;
  int failed_rank_ = -1;
  int failed_code_ = 0;
  int received_signal_ = 0;
  bool kill_pending_ = false;
  Clock::time_point kill_at_;
  // A rank stopped on an interrupt: the others are terminated at term_at_ if still running.
  bool term_pending_ = false;
  Clock::time_point term_at_;
  Clock::time_point drain_until_ = Clock::time_point::max();
};

}  // namespace

int main(int argc, char** argv) {
  // Everything after "--" is the command, untouched by option parsing.
  std::vector<std::string> cmd;
  int own_argc = argc;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--") == 0) {
      own_argc = i;
      for (int j = i + 1; j < argc; ++j) cmd.emplace_back(argv[j]);
      break;
    }
  }

  CLI::App app{
      "strata-launch: start N local ranks of a Strata program (torchrun-style env)\n"
      "usage: strata-launch --nproc N [--master-port P] [--grace S] -- CMD [ARGS...]",
      "strata-launch"};
  app.footer(kHelpFooter);
  int nproc = 0;
  int port = 0;
  double grace_s = 5.0;
  app.add_option("--nproc,--nproc-per-node", nproc, "number of local ranks to start")
      ->required()
      ->check(CLI::Range(1, 1024));
  app.add_option("--master-port", port, "rank 0's store port; 0 or absent picks a free one")
      ->check(CLI::Range(0, 65535));
  app.add_option("--grace", grace_s, "seconds between SIGTERM and SIGKILL at teardown")
      ->check(CLI::Range(0.0, 3600.0));
  try {
    app.parse(own_argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // help: 0; a bad flag: 2 (not CLI11's per-kind codes)
    return rc == 0 ? 0 : 2;
  }
  if (!std::isfinite(grace_s)) {  // NaN passes CLI::Range: no comparison with it fails
    std::fprintf(stderr, "strata-launch: --grace=%g: must be a number of seconds in [0, 3600]\n", grace_s);
    return 2;
  }
  if (cmd.empty()) {
    std::fprintf(stderr, "strata-launch: no command given: put it after '--', e.g. "
                         "strata-launch --nproc 2 -- ./my_program --flag\n");
    return 2;
  }
  if (port == 0) port = PickFreePort();
  return Supervisor(nproc, port, grace_s, std::move(cmd)).Run();
}
