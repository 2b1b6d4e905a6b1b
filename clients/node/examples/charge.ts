import { Client, Denied, NotSent, OutcomeUncertain, ToolFailed } from "@atmost/client";

/** The tool: a wallet API that takes its own idempotency key. */
export interface Wallet {
  charge(args: { amount: number; to: string; idempotencyKey: string; signal: AbortSignal }): Promise<{ tx: string }>;
}

/** Charges an order once, however often the agent loop calls this for it. */
export async function chargeOrder(client: Client, permitId: string, wallet: Wallet, orderId: string): Promise<string> {
  const request = { amount: 500, to: "acct_42" };
  try {
    const outcome = await client.guarded(
      // The key names the logical call: the same on every retry of this order.
      { permitId, tool: "wallet.charge", idempotencyKey: `order-${orderId}/charge`, request, cost: 500 },
      // Called only on DISPATCH. attemptId goes to the wallet as its own
      // idempotency key; signal aborts at the dispatch deadline.
      (attemptId, signal) => wallet.charge({ ...request, idempotencyKey: attemptId, signal }),
    );
    // A replay carries the stored bytes: here the JSON of the first answer.
    const receipt = outcome.replayed ? (JSON.parse(outcome.result.toString("utf8")) as { tx: string }) : outcome.result;
    return receipt.tx;
  } catch (error) {
    if (error instanceof Denied) return `refused: ${error.reason}`; // e.g. PERMIT_MAX_CALLS_EXCEEDED
    if (error instanceof ToolFailed) return `declined: ${error.failureReason}`;
    if (error instanceof NotSent) return "not sent: try again later";
    if (error instanceof OutcomeUncertain) return `unknown, attempt ${error.attemptId} awaits an operator`;
    throw error;
  }
}
