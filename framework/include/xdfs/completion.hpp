// How the library's asynchronous operations complete (Asio completion tokens).
#pragma once

#include <boost/asio/associated_executor.hpp>
#include <boost/asio/dispatch.hpp>
#include <boost/asio/execution/outstanding_work.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/prefer.hpp>

#include <exception>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>

namespace xdfs {

/// How an asynchronous operation of the library completes: with the failure (a TransferError,
/// or another xdfs::Error) or with its result.
template <class... Result>
using Completion = std::function<void(std::exception_ptr, Result...)>;

namespace detail {
/// Wraps an Asio completion handler as a Completion: the handler runs through its associated
/// executor (by default `ex`), as Asio's own operations run theirs.
template <class... Result, class Handler, class Executor>
Completion<Result...> completion(Handler&& handler, const Executor& ex) {
  auto h = std::make_shared<std::decay_t<Handler>>(std::forward<Handler>(handler));
  auto work = boost::asio::prefer(boost::asio::get_associated_executor(*h, ex),
                                  boost::asio::execution::outstanding_work.tracked);
  return [h, work](std::exception_ptr e, Result... r) mutable {
    auto w = std::move(work);
    boost::asio::dispatch(w, [h, e, ... r = std::move(r)]() mutable { std::move (*h)(e, std::move(r)...); });
  };
}

/// Completes `done` with `e` (and empty results) on `ex`: an operation that cannot start still
/// completes on the loop, never inside its initiating call.
template <class Executor, class... Result>
void fail_later(Executor&& ex, Completion<Result...> done, std::exception_ptr e) {
  boost::asio::post(std::forward<Executor>(ex), [done = std::move(done), e] { done(e, Result{}...); });
}
}  // namespace detail

}  // namespace xdfs
