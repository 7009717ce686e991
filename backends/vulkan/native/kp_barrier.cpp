// A global compute/transfer memory barrier as a Kompute (kp 0.9) operation.
//
// kp 0.9's Python bindings expose no memory barrier: a dispatch only records
// transfer->shader barriers on its own buffers, so a shader reading what the
// previous dispatch wrote races with it on a GPU (Vulkan sync validation reports
// READ_AFTER_WRITE). OpGlobalBarrier records one vkCmdPipelineBarrier with a
// global VkMemoryBarrier: every compute or transfer write before it is available
// and visible to every compute or transfer access after it; OpGlobalBarrier(host=True)
// also to host reads (a fence wait alone does not make device writes visible to the
// host: the backend records one after the copy back of what it will read, and only
// there, as a host destination may cost a GPU a cache flush).
//
// It derives from kp::OpBase, declared here exactly as kompute 0.9's
// operations/OpBase.hpp does (same virtual functions, same order), and is
// registered with pybind11 as a subclass of the kp module's OpBase, so
// kp.Sequence.record() accepts it. Built by tools/build_kp_barrier.py.
#include <memory>

#include <pybind11/pybind11.h>
#include <vulkan/vulkan.hpp>

namespace kp {
class OpBase
{
  public:
    virtual ~OpBase() {}
    virtual void record(const vk::CommandBuffer& commandBuffer) = 0;
    virtual void preEval(const vk::CommandBuffer& commandBuffer) = 0;
    virtual void postEval(const vk::CommandBuffer& commandBuffer) = 0;
};
} // namespace kp

namespace {

class OpGlobalBarrier : public kp::OpBase
{
  public:
    explicit OpGlobalBarrier(bool host = false)
      : host(host)
    {
    }
    void record(const vk::CommandBuffer& commandBuffer) override
    {
        const auto stages = vk::PipelineStageFlagBits::eComputeShader | vk::PipelineStageFlagBits::eTransfer;
        auto access = vk::AccessFlagBits::eShaderRead | vk::AccessFlagBits::eShaderWrite |
                      vk::AccessFlagBits::eTransferRead | vk::AccessFlagBits::eTransferWrite;
        auto dst = stages;
        if (host) { // also to host reads: after the copy back of what the host will read
            access |= vk::AccessFlagBits::eHostRead;
            dst |= vk::PipelineStageFlagBits::eHost;
        }
        const vk::MemoryBarrier barrier(vk::AccessFlagBits::eShaderWrite | vk::AccessFlagBits::eTransferWrite, access);
        commandBuffer.pipelineBarrier(stages, dst, vk::DependencyFlags(), 1, &barrier, 0, nullptr, 0, nullptr);
    }
    void preEval(const vk::CommandBuffer&) override {}
    void postEval(const vk::CommandBuffer&) override {}

  private:
    bool host;
};

} // namespace

namespace py = pybind11;

PYBIND11_MODULE(_kp_barrier, m)
{
    py::module_::import("kp"); // registers kp::OpBase with pybind11
    m.doc() = "OpGlobalBarrier: a global compute/transfer memory barrier for kp 0.9 sequences";
    py::class_<OpGlobalBarrier, kp::OpBase, std::shared_ptr<OpGlobalBarrier>>(m, "OpGlobalBarrier")
      .def(py::init<bool>(), py::arg("host") = false);
}
