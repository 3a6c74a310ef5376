// Unit discovery: which modules the engine manages as units (the default split, or the caller's
// list), the parameters registered with the partitioner unit by unit, and the chunk <-> unit maps.
#include "runtime/engine/engine_impl.h"
#include "runtime/engine/unit_rule.h"

namespace strata {

using namespace engine_detail;

namespace {

bool IsContainer(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&m) ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&m) ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&m) ||
         dynamic_cast<const UnitContainer*>(&m);
}

bool HoldsTrainable(const torch::nn::Module& m) {
  for (const auto& p : m.parameters(/*recurse=*/true))
    if (p.requires_grad()) return true;
  return false;
}

// Children of `m` that hold trainable parameters, looking through containers.
void CollectUnits(const std::string& prefix, const torch::nn::Module& m,
                  std::set<const torch::nn::Module*>* seen,
                  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>* out) {
  for (const auto& child : m.named_children()) {
    const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    if (!HoldsTrainable(*child.value())) continue;
    if (IsContainer(*child.value())) CollectUnits(name, *child.value(), seen, out);
    else if (seen->insert(child.value().get()).second) out->push_back({name, child.value()});
  }
}

}  // namespace

std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> DefaultUnitModules(
    const torch::nn::Module& root) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  std::set<const torch::nn::Module*> seen;
  CollectUnits("", root, &seen, &out);
  return out;
}

// The modules that are units: the default split, or the caller's, named by their path.
StatusOr<std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>> Engine::Impl::UnitModules(
    const EngineOptions& options) const {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> found;
  if (options.units.empty()) return DefaultUnitModules(*model_.module);
  // Names for the units the caller chose: their path under the root.
  std::map<const torch::nn::Module*, std::string> names;
  for (const auto& item : model_.module->named_modules("", /*include_self=*/false))
    names.emplace(item.value().get(), item.key());
  for (const auto& u : options.units) {
    if (!u) return InvalidArgument("EngineOptions::units holds a null module");
    auto it = names.find(u.get());
    if (it == names.end())
      return InvalidArgument(StrCat("EngineOptions::units names a module (", u->name(),
                                    ") that is not part of the model"));
    found.push_back({it->second, u});
  }
  return found;
}

// Registers a unit and its trainable parameters with the partitioner, each parameter once (a
// tied parameter belongs to the first unit holding it and is shared by the others).
Status Engine::Impl::AddUnit(const std::string& name, std::shared_ptr<torch::nn::Module> module,
                             const std::vector<std::pair<std::string, torch::Tensor>>& named,
                             bool always_live, Partitioner& part,
                             std::map<const c10::TensorImpl*, int64_t>& seen) {
  UnitCoordinator::Unit info;
  info.name = name;
  info.module = std::move(module);
  info.always_live = always_live;
  const int64_t u = units_.size();  // the index Add gives it
  for (const auto& [pname, p] : named) {
    if (!p.requires_grad()) continue;
    auto it = seen.find(p.unsafeGetTensorImpl());
    int64_t id;
    if (it != seen.end()) {
      id = it->second;
      if (std::find(info.params.begin(), info.params.end(), id) != info.params.end()) continue;
    } else {
      const std::string full_name = name.empty() ? pname : name + "." + pname;
      // A closed stage-3 engine leaves its parameters with 0 elements, viewing storage it
      // marked (ChunkMaterializer::Close); training them would train nothing, so such a model
      // is refused here, as is any parameter with elements but no memory.
      const ChunkMaterializer::ClosedChunk closed = ChunkMaterializer::ClosedChunkOf(p);
      if (closed == ChunkMaterializer::ClosedChunk::kStartFailed)
        return FailedPrecondition(StrCat(
            "parameter '", full_name, "' has no values: an earlier engine start on this model failed "
            "part-way (its error said why) after it had taken this parameter into its tiers, and they "
            "went with it; build the model again (under zero.Init where it was) before starting an "
            "engine on it"));
      if (closed == ChunkMaterializer::ClosedChunk::kClosed ||
          (p.numel() > 0 && (!p.has_storage() || p.data_ptr() == nullptr)))
        return FailedPrecondition(StrCat(
            "parameter '", full_name, "' has no memory: the model belongs to a ZeRO-3 engine "
            "that was closed; call engine.destroy() (it gives the model its weights back) "
            "instead of close(), or load a checkpoint into a new model"));
      // The chunks hold real floating values: a complex parameter would be cast to its real
      // part (with only LibTorch's warning) and train so.
      if (!p.is_floating_point())
        return InvalidArgument(
            StrCat("parameter '", full_name, "' is ", c10::toString(p.scalar_type()),
                   ": the engine trains real floating-point parameters (fp32, bf16, fp16, "
                   "fp64); keep a complex one as two real ones (torch.view_as_real)"));
      // A parameter staged by zero::Init has 0 elements; its staged shape is its own.
      std::vector<int64_t> shape = zero::StagedShape(p).value_or(p.sizes().vec());
      const int64_t numel = c10::multiply_integers(shape);
      STRATA_ASSIGN_OR_RETURN(id, part.AddParam(full_name, numel));
      STRATA_DCHECK(id == static_cast<int64_t>(params_.size()));
      params_.push_back({p, std::move(shape), {}, nullptr});
      seen.emplace(p.unsafeGetTensorImpl(), id);
    }
    params_[id].units.push_back(u);
    info.params.push_back(id);
  }
  units_.Add(std::move(info));
  return Status::Ok();
}

Status Engine::Impl::DiscoverUnits(const EngineOptions& options, optim::DType compute_dtype) {
  STRATA_ASSIGN_OR_RETURN(auto found, UnitModules(options));
  const PartitionerOptions po =
      StepPlan::ChunkLayout(config_, config_.zero_optimization.stage == 0 ? 1 : comm_->world_size(),
                            static_cast<int>(optim::DTypeSize(compute_dtype)));
  STRATA_ASSIGN_OR_RETURN(Partitioner part, Partitioner::Create(po));
  std::map<const c10::TensorImpl*, int64_t> seen;
  // The root's own parameters first: one more unit, gathered for the engine's life.
  std::vector<std::pair<std::string, torch::Tensor>> own;
  for (const auto& item : model_.module->named_parameters(/*recurse=*/false)) own.push_back({item.key(), item.value()});
  if (!own.empty()) STRATA_RETURN_IF_ERROR(AddUnit("", model_.module, own, /*always_live=*/true, part, seen));
  std::set<const torch::nn::Module*> unit_modules;
  for (auto& [name, module] : found) {
    if (!unit_modules.insert(module.get()).second)
      return InvalidArgument(StrCat("unit '", name, "' is listed twice"));
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& item : module->named_parameters(/*recurse=*/true)) named.push_back({item.key(), item.value()});
    STRATA_RETURN_IF_ERROR(AddUnit(name, module, named, /*always_live=*/false, part, seen));
  }
  // Trainable parameters outside every unit would never be gathered.
  for (const auto& item : model_.module->named_parameters(/*recurse=*/true)) {
    if (item.value().requires_grad() && !seen.count(item.value().unsafeGetTensorImpl()))
      return InvalidArgument(StrCat("parameter '", item.key(),
                                    "' is in no unit; add the module holding it to "
                                    "EngineOptions::units (or leave units empty for the default)"));
  }
  if (params_.empty()) return InvalidArgument("the model has no trainable parameters");
  // fp64 parameters train in the engine's precision (an fp32 master, the compute dtype's
  // working copy), so the model's forward meets fp32 weights: say so before an fp64 input does.
  int64_t fp64 = 0;
  std::string first_fp64;
  for (const auto& item : model_.module->named_parameters(/*recurse=*/true))
    if (item.value().requires_grad() && item.value().scalar_type() == torch::kDouble && fp64++ == 0)
      first_fp64 = item.key();
  if (fp64 > 0)
    STRATA_LOG(WARN)
        << fp64 << " parameter(s) are float64 (the first '" << first_fp64
        << "'): the engine trains them in fp32 (or the configured 16-bit dtype), as their "
        << "working copies; feed the model float32 inputs (model.float() before initialize "
        << "makes the model match)";
  STRATA_RETURN_IF_ERROR(part.Finalize());
  partitioner_.emplace(std::move(part));
  MapUnitsToChunks();
  // Buffers, each once.
  std::set<const c10::TensorImpl*> seen_buffers;
  for (const auto& item : model_.module->named_buffers(/*recurse=*/true))
    if (seen_buffers.insert(item.value().unsafeGetTensorImpl()).second)
      buffers_.push_back({item.key(), item.value()});
  // Frozen parameters, each once (a tied one under its first name).
  std::set<const c10::TensorImpl*> seen_frozen;
  for (const auto& item : model_.module->named_parameters(/*recurse=*/true))
    if (!item.value().requires_grad() &&
        seen_frozen.insert(item.value().unsafeGetTensorImpl()).second)
      frozen_.push_back({item.key(), item.value()});
  return Status::Ok();
}

// The chunk table, and each unit's chunks and each chunk's units.
void Engine::Impl::MapUnitsToChunks() {
  const auto& chunk_infos = partitioner_->chunks();
  std::vector<int64_t> chunk_numel;
  for (const ChunkInfo& ci : chunk_infos) chunk_numel.push_back(ci.numel);
  chunks_ = ChunkTable(std::move(chunk_numel));
  for (int64_t u = 0; u < units_.size(); ++u) {
    UnitCoordinator::Unit& info = units_[u];
    for (int64_t pid : info.params) {
      const int64_t c = partitioner_->location(pid).chunk;
      if (std::find(info.chunks.begin(), info.chunks.end(), c) == info.chunks.end()) {
        info.chunks.push_back(c);
        chunks_[c].units.push_back(static_cast<int64_t>(u));
      }
    }
    for (int64_t c : info.chunks) info.elems += chunk_infos[c].numel;
  }
}

}  // namespace strata
