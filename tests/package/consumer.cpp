// Links every layer through the installed package: a server on a free port and an upload.
#include <xdfs/client.hpp>
#include <xdfs/server.hpp>
#include <xdfs/xsec.hpp>
#include <xdfs/xdfs.hpp>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/use_future.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  // Every channel is authenticated: this process's client key (made on first use) is the one
  // key its own server admits. The server keeps its identity in a private state directory.
  char tmpl[] = "/tmp/xdfs-consumer-XXXXXX";
  const std::string state = ::mkdtemp(tmpl);
  auto me = xdfs::xsec::load_or_create_key(xdfs::xsec::default_config_dir() + "/id_x25519");
  std::ofstream(state + "/authorized_keys") << xdfs::xsec::format_public(me.public_key) << " rw\n";
  xdfs::ServerConfig cfg;
  cfg.root = argv[1];
  cfg.state_dir = state;
  cfg.listen = "127.0.0.1:0";
  cfg.log = [](const std::string&) {};
  xdfs::Server server(cfg, xdfs::runtime::session_factory(xdfs::standard_modes()));
  std::thread t([&] { server.run(); });
  auto r = xdfs::upload(argv[2], {"127.0.0.1", server.port()}, "copy", {});
  // The asynchronous form through the installed headers: a second copy on a session, completed
  // through a future while another thread runs the session's loop.
  {
    xdfs::Session s({"127.0.0.1", server.port()}, {});
    auto work = boost::asio::make_work_guard(s.io());
    std::thread loop([&] { s.io().run(); });
    auto f = xdfs::async_upload(s, argv[2], "copy2", {}, boost::asio::use_future);
    const auto r2 = f.get();
    work.reset();
    loop.join();
    s.close();
    if (r2.bytes != r.bytes) return 1;
  }
  server.stop();
  t.join();
  std::filesystem::remove_all(state);
  std::printf("consumer moved %llu bytes\n", static_cast<unsigned long long>(r.bytes));
  return 0;
}
